//! `grep`: lines matching a regular expression, in the files under the session directory
//! (or under a path inside it).
//!
//! Invariants: files are found by the shared walk (never outside the session directory,
//! `.gitignore` respected, `.git` skipped) in a stable order; binary files (a NUL byte near
//! the start) are skipped; each match is one `file:line: text` line with a long line cut;
//! the output keeps its first bytes and counts the rest, so memory stays bounded however
//! many lines match.

use std::io::{BufRead, BufReader};
use std::path::Path;

use keel_schema::types::Effect;
use regex::Regex;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use super::path::{self, Beneath};
use super::truncate::Capped;
use super::walk::{self, File};
use super::{Context, Error, Output, Run, Tool, blocking, input, text};

/// Characters of a matching line shown; the rest is elided.
const MAX_LINE_CHARS: usize = 500;
/// How much of a file is looked at to decide it is binary.
const SNIFF_BYTES: usize = 8192;

/// The `grep` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct Grep;

/// Input of `grep`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// A regular expression (Rust `regex` syntax), matched against each line.
    pub pattern: String,
    /// A file or directory to search, relative to the session directory (default: the
    /// session directory).
    #[serde(default)]
    pub path: Option<String>,
}

impl Tool for Grep {
    fn name(&self) -> &'static str {
        "grep"
    }

    fn description(&self) -> &'static str {
        "Search file contents with a regular expression; prints `file:line: text` for each \
         matching line. Files ignored by .gitignore and binary files are skipped."
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
            let regex = Regex::new(&input.pattern)
                .map_err(|e| Error::InvalidInput(format!("invalid regular expression: {e}")))?;
            let root = context.directory.clone();
            let start = path::resolve(&root, input.path.as_deref().unwrap_or("."))?;
            if !start.real.exists() {
                return Err(Error::NotFound(start.shown));
            }
            let max = context.limits.max_output_bytes;
            let cancel = context.cancel.clone();
            blocking(move || {
                let beneath = Beneath::new(&root)?;
                let mut out = Capped::new(max);
                let mut matches = 0usize;
                let mut files = 0usize;
                walk::files(&beneath, &start.real, &cancel, |file| {
                    let found = search(&beneath, &regex, &file, &mut out);
                    matches += found;
                    files += usize::from(found > 0);
                })?;
                let listed = out.finish();
                let (body, truncated) = if matches == 0 {
                    (format!("(no lines match `{}`)", input.pattern), false)
                } else {
                    (listed.text, listed.truncated)
                };
                Ok(Output {
                    structured: json!({
                        "pattern": input.pattern,
                        "matches": matches,
                        "files": files,
                        "truncated": truncated,
                    }),
                    content: text(body),
                })
            })
            .await
        })
    }
}

/// Appends the matching lines of `file` to `out`; returns how many matched. A file that
/// cannot be read, or is binary, has none.
fn search(beneath: &Beneath, regex: &Regex, file: &File, out: &mut Capped) -> usize {
    let Ok(handle) = beneath.open(&file.real, path::READ, 0) else {
        return 0;
    };
    let mut reader = BufReader::with_capacity(SNIFF_BYTES, handle);
    match reader.fill_buf() {
        Ok(head) if !head.contains(&0) => {}
        _ => return 0,
    }
    let mut found = 0;
    let mut line = Vec::new();
    let mut number = 0usize;
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        number += 1;
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end_matches(['\n', '\r']);
        if !regex.is_match(text) {
            continue;
        }
        found += 1;
        let shown: String = text.chars().take(MAX_LINE_CHARS).collect();
        let elided = if shown.len() < text.len() { " …" } else { "" };
        if out.is_empty() {
            out.push_str(&format!("{}:{number}: {shown}{elided}", file.shown));
        } else {
            out.push_str(&format!("\n{}:{number}: {shown}{elided}", file.shown));
        }
    }
    found
}
