//! The web console's build: `console/dist/` (index.html, console.css and console.js, the
//! bundle esbuild makes from `console/src` and the TypeScript client's sources), which
//! `keel serve` embeds. `regenerate` rewrites it; `check` fails when the committed build
//! differs from a fresh one. Both need `npm ci` in `console` first; without it, `check`
//! says the console was not checked, and fails in CI.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The package's directory, from the workspace root.
pub const PACKAGE: &str = "console";
/// The committed build, from the workspace root.
pub const DIST: &str = "console/dist";
/// The files of a build.
const FILES: [&str; 3] = ["index.html", "console.css", "console.js"];

/// What to tell someone whose checkout has no build tools.
pub const INSTALL: &str = "the console's build tools are not installed: run `npm ci` in console";

/// A build's files: name and contents.
pub type Built = Vec<(&'static str, Vec<u8>)>;

/// A fresh build's files, or `None` when the tools are not installed.
pub fn build(root: &Path) -> Result<Option<Built>> {
    let package = root.join(PACKAGE);
    if !package.join("node_modules/esbuild").exists() {
        return Ok(None);
    }
    let out = tempfile::tempdir().context("a temporary directory for the console's build")?;
    let output = Command::new("node")
        .arg("build.mjs")
        .arg(out.path())
        .current_dir(&package)
        .output()
        .context("running node build.mjs in console")?;
    if !output.status.success() {
        bail!(
            "the console's build failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    FILES
        .iter()
        .map(|name| {
            let contents = std::fs::read(out.path().join(name))
                .with_context(|| format!("reading the built {name}"))?;
            Ok((*name, contents))
        })
        .collect::<Result<_>>()
        .map(Some)
}

/// The committed files that differ from `built` (missing ones included).
pub fn stale(root: &Path, built: &Built) -> Vec<String> {
    built
        .iter()
        .filter(|(name, contents)| {
            std::fs::read(root.join(DIST).join(name)).ok().as_ref() != Some(contents)
        })
        .map(|(name, _)| format!("{DIST}/{name}"))
        .collect()
}
