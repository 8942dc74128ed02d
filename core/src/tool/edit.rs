//! `edit`: replaces one exact occurrence of a text in a file.
//!
//! Invariant: the file changes only when `old` occurs exactly once (occurrences counted
//! overlapping, so `aa` in `aaa` is ambiguous); otherwise the file is untouched and the
//! model reads [`Error::EditMatch`] saying how many times it was found.

use keel_schema::types::Effect;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use std::io::{Read as _, Seek as _, Write as _};
use std::path::Path;

use super::path::{self, Beneath, Resolved};
use super::{Context, Error, Output, Run, Tool, blocking, input, text};

/// The `edit` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct Edit;

/// Input of `edit`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// The file, relative to the session directory.
    pub path: String,
    /// The exact text to replace; it must occur exactly once in the file.
    pub old: String,
    /// The text to put in its place.
    pub new: String,
}

impl Tool for Edit {
    fn name(&self) -> &'static str {
        "edit"
    }

    fn description(&self) -> &'static str {
        "Replace an exact text in a file with a new one. `old` must occur exactly once: \
         include enough surrounding lines to make it unique."
    }

    fn effect(&self) -> Effect {
        Effect::Write
    }

    fn input_schema(&self) -> Value {
        input::schema::<Input>()
    }

    fn permission_pattern(&self, input: &Value, root: &Path) -> String {
        path::permission_path(root, input::field(input, "path", ""))
    }

    fn run<'a>(&'a self, input: Value, context: &'a Context) -> Run<'a> {
        Box::pin(async move {
            let input: Input = input::parse(input)?;
            if input.old.is_empty() {
                return Err(Error::InvalidInput(
                    "`old` must not be empty; use `write` to create or replace a whole file".into(),
                ));
            }
            let file = path::resolve(&context.directory, &input.path)?;
            let root = context.directory.clone();
            blocking(move || edit(&Beneath::new(&root)?, &file, &input.old, &input.new)).await
        })
    }
}

fn edit(beneath: &Beneath, file: &Resolved, old: &str, new: &str) -> Result<Output, Error> {
    let shown = file.shown.as_str();
    let io = |e: std::io::Error| path::failure(shown, &e);
    let not_regular = || Error::Io(format!("`{shown}` is not a regular file"));
    let flags = libc::O_RDWR | libc::O_NONBLOCK | libc::O_NOCTTY;
    let mut handle = beneath
        .open(&file.real, flags, 0)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::EISDIR | libc::ENXIO) => not_regular(),
            _ => io(e),
        })?;
    if !handle.metadata().map_err(io)?.is_file() {
        return Err(not_regular());
    }
    let mut bytes = Vec::new();
    handle.read_to_end(&mut bytes).map_err(io)?;
    let current = String::from_utf8(bytes).map_err(|_| {
        Error::Io(format!(
            "`{shown}` is not UTF-8 text; `edit` changes text files"
        ))
    })?;
    let found = occurrences(&current, old);
    let Some(&at) = found.first().filter(|_| found.len() == 1) else {
        let advice = if found.is_empty() {
            "it must match exactly, whitespace and indentation included; read the file first"
        } else {
            "include more surrounding lines so it matches exactly once"
        };
        return Err(Error::EditMatch(format!(
            "`old` was found {} times in `{shown}`, it must be found exactly once: {advice}",
            found.len()
        )));
    };
    let mut updated = String::with_capacity(current.len() - old.len() + new.len());
    updated.push_str(&current[..at]);
    updated.push_str(new);
    updated.push_str(&current[at + old.len()..]);
    handle.rewind().map_err(io)?;
    handle.set_len(0).map_err(io)?;
    handle.write_all(updated.as_bytes()).map_err(io)?;
    Ok(Output {
        structured: json!({ "path": shown, "replacements": 1 }),
        content: text(format!("edited `{shown}`")),
    })
}

/// Byte offsets of every occurrence of `needle` in `haystack`, overlapping ones included.
fn occurrences(haystack: &str, needle: &str) -> Vec<usize> {
    let mut found = Vec::new();
    if needle.is_empty() {
        return found;
    }
    let mut from = 0;
    while let Some(i) = haystack[from..].find(needle) {
        let at = from + i;
        found.push(at);
        // Step one character, not the whole needle, so overlapping matches count too.
        from = at + haystack[at..].chars().next().map_or(1, char::len_utf8);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn occurrences_count_overlapping_matches() {
        assert_eq!(occurrences("aaa", "aa"), vec![0, 1]);
        assert_eq!(occurrences("héhé", "é"), vec![1, 4]);
        assert_eq!(occurrences("abc", "x"), Vec::<usize>::new());
    }
}
