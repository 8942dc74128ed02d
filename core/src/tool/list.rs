//! `list`: the entries of a directory.
//!
//! Invariants: entries are sorted by name, directories end with `/`, hidden entries are
//! included and `.gitignore` is not consulted (this is a plain listing). A symlink is
//! listed only when its real location is inside the session directory (marked `/` when it
//! leads to a directory); one leading outside, or nowhere, is left out, so nothing outside
//! the session directory is revealed. The output is truncated like every tool's.

use keel_schema::types::Effect;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use std::path::Path;

use super::path::{self, Beneath, Resolved};
use super::truncate::{Truncated, truncate};
use super::{Context, Error, Output, Run, Tool, blocking, input, text};

/// The `list` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct List;

/// Input of `list`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// The directory, relative to the session directory (default: the session directory).
    #[serde(default)]
    pub path: Option<String>,
}

impl Tool for List {
    fn name(&self) -> &'static str {
        "list"
    }

    fn description(&self) -> &'static str {
        "List a directory's entries, sorted; directories end with `/`."
    }

    fn effect(&self) -> Effect {
        Effect::Read
    }

    fn input_schema(&self) -> Value {
        input::schema::<Input>()
    }

    fn permission_pattern(&self, input: &Value, root: &Path) -> String {
        path::permission_path(root, input::field(input, "path", "."))
    }

    fn run<'a>(&'a self, input: Value, context: &'a Context) -> Run<'a> {
        Box::pin(async move {
            let input: Input = input::parse(input)?;
            let requested = input.path.as_deref().unwrap_or(".");
            let dir = path::resolve(&context.directory, requested)?;
            let root = context.directory.clone();
            let max = context.limits.max_output_bytes;
            blocking(move || list(&root, &dir, max)).await
        })
    }
}

fn list(root: &Path, dir: &Resolved, max_bytes: usize) -> Result<Output, Error> {
    let shown = dir.shown.as_str();
    let io = |e: std::io::Error| path::failure(shown, &e);
    let not_a_directory = || {
        Error::Io(format!(
            "`{shown}` is not a directory; use `read` to see a file"
        ))
    };
    let handle = Beneath::new(root)?
        .open(&dir.real, path::READ | libc::O_DIRECTORY, 0)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTDIR) => not_a_directory(),
            _ => io(e),
        })?;
    let mut names = Vec::new();
    for entry in path::read_dir(&handle).map_err(io)? {
        let entry = entry.map_err(io)?;
        let kind = entry.file_type().map_err(io)?;
        let is_dir = if kind.is_symlink() {
            match path::real_inside(root, &dir.real.join(entry.file_name())) {
                Some(real) => real.is_dir(),
                None => continue,
            }
        } else {
            kind.is_dir()
        };
        let mut name = entry.file_name().to_string_lossy().into_owned();
        if is_dir {
            name.push('/');
        }
        names.push(name);
    }
    names.sort();
    let listed = if names.is_empty() {
        Truncated {
            text: format!("(`{shown}` is empty)"),
            truncated: false,
        }
    } else {
        truncate(&names.join("\n"), max_bytes)
    };
    Ok(Output {
        structured: json!({ "path": shown, "entries": names.len(), "truncated": listed.truncated }),
        content: text(listed.text),
    })
}
