//! Published event schemas, read from git.
//!
//! An event schema is published once it is in `contracts/events/` on the base branch
//! (`main`, or `KEEL_CONTRACTS_BASE`). What counts is the schema as it was when it first
//! arrived there, so a change committed to the base branch later is still caught.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use keel_codegen::check::Published;
use keel_codegen::{EVENTS_DIR, INDEX_PATH};

pub enum Base {
    Found {
        name: String,
        files: BTreeMap<String, Published>,
    },
    Missing {
        name: String,
    },
}

fn git(root: &Path, args: &[&str]) -> Result<Option<String>> {
    let output = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .output()
        .context("running git (needed to find published contracts)")?;
    if !output.status.success() {
        return Ok(None);
    }
    String::from_utf8(output.stdout)
        .map(Some)
        .context("git printed something that is not UTF-8")
}

/// Every published event schema, as first published on the base branch.
pub fn read(root: &Path) -> Result<Base> {
    let name = std::env::var("KEEL_CONTRACTS_BASE").unwrap_or_else(|_| "main".to_owned());
    let verify = format!("{name}^{{commit}}");
    if git(root, &["rev-parse", "--verify", "--quiet", &verify])?.is_none() {
        return Ok(Base::Missing { name });
    }
    let Some(listing) = git(
        root,
        &["ls-tree", "-r", "--name-only", &name, "--", EVENTS_DIR],
    )?
    else {
        bail!("git could not list {EVENTS_DIR} on `{name}`");
    };
    let mut files = BTreeMap::new();
    for path in listing
        .lines()
        .filter(|p| p.ends_with(".json") && *p != INDEX_PATH)
    {
        // The oldest commit on the base branch that added the file; in a shallow clone it
        // may be missing, and then the branch tip's version is what was published.
        let added = git(
            root,
            &[
                "log",
                "--diff-filter=A",
                "--format=%H",
                "--reverse",
                &name,
                "--",
                path,
            ],
        )?
        .and_then(|out| out.lines().next().map(str::to_owned));
        let commit = added.unwrap_or_else(|| name.clone());
        let Some(contents) = git(root, &["show", &format!("{commit}:{path}")])? else {
            bail!("git could not read {path} at {commit}");
        };
        let source = format!("on `{name}` since {}", &commit[..commit.len().min(12)]);
        files.insert(path.to_owned(), Published { contents, source });
    }
    Ok(Base::Found { name, files })
}
