//! `write`: creates or replaces a file with the given content.
//!
//! Invariants: the file and any parent directories created for it are inside the session
//! directory (the path, with symlinks resolved, is checked before anything is created);
//! an existing directory or special file (a FIFO, say) is never written to.

use keel_schema::types::Effect;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use std::path::Path;

use super::path::{self, Resolved};
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
            blocking(move || write(&file, &input.content)).await
        })
    }
}

fn write(file: &Resolved, content: &str) -> Result<Output, Error> {
    let shown = file.shown.as_str();
    let io = |e: std::io::Error| Error::from_io(shown, &e);
    let created = match std::fs::metadata(&file.real) {
        Ok(meta) if meta.is_dir() => {
            return Err(Error::Io(format!("`{shown}` is a directory")));
        }
        Ok(meta) if !meta.is_file() => {
            return Err(Error::Io(format!("`{shown}` is not a regular file")));
        }
        Ok(_) => false,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => return Err(io(e)),
    };
    if let Some(parent) = file.real.parent() {
        // `real` has every existing symlink resolved, so what is created here is exactly
        // what was checked to be inside.
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    std::fs::write(&file.real, content).map_err(io)?;
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
