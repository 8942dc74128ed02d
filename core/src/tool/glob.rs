//! `glob`: the files under the session directory whose path matches a glob.
//!
//! Patterns have `.gitignore` syntax: one without a `/` matches a file name at any depth
//! (`*.rs`), one with a `/` is anchored at the session directory (`src/*.rs`), and `**`
//! spans directories (`src/**/*.rs`). An absolute pattern inside the session directory is
//! taken relative to it. Invariants: only regular files are reported, as sorted relative
//! paths, found by the shared walk (so never outside the session directory, `.gitignore`
//! respected, `.git` skipped); the output is truncated like every tool's.

use std::path::Path;

use ignore::gitignore::{Gitignore, GitignoreBuilder};
use keel_schema::types::Effect;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use super::path::Beneath;
use super::truncate::truncate;
use super::{Context, Error, Output, Run, Tool, blocking, input, text, walk};

/// The `glob` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct Glob;

/// Input of `glob`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// A glob in `.gitignore` syntax, e.g. `*.rs` (any depth) or `src/**/*.ts`.
    pub pattern: String,
}

impl Tool for Glob {
    fn name(&self) -> &'static str {
        "glob"
    }

    fn description(&self) -> &'static str {
        "Find files by path pattern (`*.rs` at any depth, `src/**/*.ts` under src); \
         files ignored by .gitignore are skipped."
    }

    fn effect(&self) -> Effect {
        Effect::Read
    }

    fn input_schema(&self) -> Value {
        input::schema::<Input>()
    }

    fn permission_pattern(&self, input: &Value, _root: &Path) -> String {
        input::field(input, "pattern", "").to_owned()
    }

    fn run<'a>(&'a self, input: Value, context: &'a Context) -> Run<'a> {
        Box::pin(async move {
            let input: Input = input::parse(input)?;
            let root = context.directory.clone();
            let matcher = matcher(&root, &input.pattern)?;
            let max = context.limits.max_output_bytes;
            let cancel = context.cancel.clone();
            blocking(move || {
                let mut found = Vec::new();
                walk::files(&Beneath::new(&root)?, &root, &cancel, |file| {
                    if matcher.matched(&file.shown, false).is_ignore() {
                        found.push(file.shown);
                    }
                })?;
                found.sort();
                let listed = if found.is_empty() {
                    format!("(no files match `{}`)", input.pattern)
                } else {
                    found.join("\n")
                };
                let listed = truncate(&listed, max);
                Ok(Output {
                    structured: json!({
                        "pattern": input.pattern,
                        "files": found.len(),
                        "truncated": listed.truncated,
                    }),
                    content: text(listed.text),
                })
            })
            .await
        })
    }
}

/// A matcher for `pattern`; a path matches when the matcher calls it "ignored" (the
/// gitignore machinery is used only for its glob semantics).
fn matcher(root: &Path, pattern: &str) -> Result<Gitignore, Error> {
    let invalid = |why: String| Error::InvalidInput(format!("invalid glob `{pattern}`: {why}"));
    let prefix = format!("{}/", root.display());
    let relative = pattern.strip_prefix(&prefix).unwrap_or(pattern);
    if relative.trim().is_empty() {
        return Err(invalid("it is empty".into()));
    }
    if relative.starts_with('!') || relative.starts_with('#') {
        return Err(invalid("it must not start with `!` or `#`".into()));
    }
    let mut builder = GitignoreBuilder::new(root);
    builder
        .add_line(None, relative)
        .map_err(|e| invalid(e.to_string()))?;
    builder.build().map_err(|e| invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(pattern: &str, path: &str) -> bool {
        matcher(Path::new("/s"), pattern)
            .expect("valid glob")
            .matched(path, false)
            .is_ignore()
    }

    #[test]
    fn patterns_follow_gitignore_rules() {
        assert!(matches("*.rs", "a.rs"));
        assert!(matches("*.rs", "src/deep/a.rs"));
        assert!(matches("src/*.rs", "src/a.rs"));
        assert!(!matches("src/*.rs", "src/deep/a.rs"));
        assert!(matches("src/**/*.rs", "src/deep/a.rs"));
        assert!(matches("/s/src/*.rs", "src/a.rs"));
        assert!(!matches("*.rs", "a.txt"));
    }

    #[test]
    fn negated_and_empty_patterns_are_invalid_input() {
        for bad in ["", "  ", "!*.rs", "# comment"] {
            assert!(
                matches!(matcher(Path::new("/s"), bad), Err(Error::InvalidInput(_))),
                "{bad:?}"
            );
        }
    }
}
