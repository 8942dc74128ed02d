//! `write`: creates or replaces a file with the given content.
//!
//! Invariants: the file and any parent directories created for it are inside the session
//! directory (the path, with symlinks resolved, is checked before anything is created, and
//! each is created beneath the open session directory, see [`path`]); an existing
//! directory or special file (a FIFO, say) is never written to.

use keel_schema::types::Effect;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use std::io::Write as _;
use std::path::Path;

use super::path::{self, Beneath, Resolved};
use super::{Context, Error, Output, Run, Tool, blocking, input, text};

/// The `write` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct Write;

/// Input of `write`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// The file, relative to the session directory. Missing parent directories are created.
    pub path: String,
    /// The whole new content of the file.
    pub content: String,
}

impl Tool for Write {
    fn name(&self) -> &'static str {
        "write"
    }

    fn description(&self) -> &'static str {
        "Create a file, or replace its whole content, creating missing parent directories."
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
            let file = path::resolve(&context.directory, &input.path)?;
            let root = context.directory.clone();
            blocking(move || write(&Beneath::new(&root)?, &file, &input.content)).await
        })
    }
}

fn write(beneath: &Beneath, file: &Resolved, content: &str) -> Result<Output, Error> {
    let shown = file.shown.as_str();
    let io = |e: std::io::Error| path::failure(shown, &e);
    if let Some(parent) = file.real.parent() {
        beneath.create_dir_all(parent).map_err(io)?;
    }
    let create = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOCTTY;
    let (mut handle, created) = match beneath.open(&file.real, create, 0o666) {
        Ok(handle) => (handle, true),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            // Opened without truncating, so a file that is not a regular one is left as
            // it was; O_NONBLOCK keeps a FIFO without a reader from blocking the open.
            let existing = libc::O_WRONLY | libc::O_NONBLOCK | libc::O_NOCTTY;
            let handle =
                beneath
                    .open(&file.real, existing, 0)
                    .map_err(|e| match e.raw_os_error() {
                        Some(libc::EISDIR) => Error::Io(format!("`{shown}` is a directory")),
                        Some(libc::ENXIO) => Error::Io(format!("`{shown}` is not a regular file")),
                        _ => io(e),
                    })?;
            if !handle.metadata().map_err(io)?.is_file() {
                return Err(Error::Io(format!("`{shown}` is not a regular file")));
            }
            handle.set_len(0).map_err(io)?;
            (handle, false)
        }
        Err(e) => return Err(io(e)),
    };
    handle.write_all(content.as_bytes()).map_err(io)?;
    let bytes = content.len();
    let summary = if created {
        format!("created `{shown}` ({bytes} bytes)")
    } else {
        format!("wrote `{shown}` ({bytes} bytes)")
    };
    Ok(Output {
        structured: json!({ "path": shown, "bytes": bytes, "created": created }),
        content: text(summary),
    })
}
