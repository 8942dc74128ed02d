//! What the tool tests share: a session directory with something outside it, and calls.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_core::tool::{Context, Error, Limits, Output, Tool, builtins};
use keel_schema::types::ToolContent;
use serde_json::Value;
use tempfile::TempDir;
use tokio_util::sync::CancellationToken;

/// A 1×1 transparent PNG.
pub const PIXEL_PNG: &[u8] = &[
    0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1F, 0x15, 0xC4,
    0x89, 0x00, 0x00, 0x00, 0x0A, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9C, 0x63, 0x00, 0x01, 0x00, 0x00,
    0x05, 0x00, 0x01, 0x0D, 0x0A, 0x2D, 0xB4, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4E, 0x44, 0xAE,
    0x42, 0x60, 0x82,
];

/// A session directory (`<tmp>/session`) with a sibling `<tmp>/outside` holding
/// `secret.txt`, so `../outside/secret.txt` names a real file outside.
pub struct Session {
    _tmp: TempDir,
    pub root: PathBuf,
    pub outside: PathBuf,
    pub context: Context,
}

impl Session {
    pub fn new() -> Self {
        Self::with_limits(Limits::default())
    }

    pub fn with_limits(limits: Limits) -> Self {
        let tmp = tempfile::tempdir().expect("temp dir");
        let base = tmp.path().canonicalize().expect("canonical temp dir");
        let root = base.join("session");
        let outside = base.join("outside");
        std::fs::create_dir_all(&root).expect("session dir");
        std::fs::create_dir_all(outside.join("dir")).expect("outside dir");
        std::fs::write(outside.join("secret.txt"), "secret needle\n").expect("secret");
        std::fs::write(outside.join("dir/deep.txt"), "deep needle\n").expect("deep secret");
        let context = Context {
            directory: root.clone(),
            cancel: CancellationToken::new(),
            limits,
            progress: None,
            call: None,
            sandbox: None,
        };
        Self {
            _tmp: tmp,
            root,
            outside,
            context,
        }
    }

    pub fn file(&self, relative: &str, content: impl AsRef<[u8]>) {
        let path = self.root.join(relative);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("parent dirs");
        }
        std::fs::write(path, content).expect("write fixture");
    }

    pub fn link(&self, relative: &str, target: impl AsRef<Path>) {
        symlink(target, self.root.join(relative)).expect("symlink");
    }

    pub async fn call(&self, tool: &str, input: Value) -> Result<Output, Error> {
        call_with(&self.context, tool, input).await
    }
}

pub fn tool(name: &str) -> Arc<dyn Tool> {
    builtins().get(name).cloned().expect("a built-in tool")
}

pub async fn call_with(context: &Context, name: &str, input: Value) -> Result<Output, Error> {
    tool(name).run(input, context).await
}

/// The text the model sees.
pub fn text(output: &Output) -> String {
    output
        .content
        .iter()
        .map(|c| match c {
            ToolContent::Text { text } => text.as_str(),
            ToolContent::Media { .. } => "<media>",
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn escape(path: &str) -> Result<Output, Error> {
    Err(Error::PathEscape(path.to_owned()))
}
