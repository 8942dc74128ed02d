//! The TypeScript client's generated types: `clients/typescript/src/generated/openapi.ts`,
//! written by openapi-typescript (the version pinned in the package's lock file) from
//! `contracts/openapi.json`. `regenerate` rewrites it; `check` fails when it is stale.
//!
//! The generator is a Node package, so both need `npm ci` in `clients/typescript` first.
//! Without it, `check` says the TypeScript client was not checked, and fails in CI.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The package's directory, from the workspace root.
pub const PACKAGE: &str = "clients/typescript";
/// The generated file, from the workspace root.
pub const GENERATED: &str = "clients/typescript/src/generated/openapi.ts";

/// The generator, if the package's dependencies are installed.
fn generator(root: &Path) -> Option<PathBuf> {
    let path = root
        .join(PACKAGE)
        .join("node_modules/.bin/openapi-typescript");
    path.exists().then_some(path)
}

/// What to tell someone whose checkout has no generator.
pub const INSTALL: &str =
    "the TypeScript client's tools are not installed: run `npm ci` in clients/typescript";

/// The types openapi-typescript generates from the OpenAPI document `openapi`, or `None`
/// when the generator is not installed.
pub fn generate(root: &Path, openapi: &str) -> Result<Option<String>> {
    let Some(generator) = generator(root) else {
        return Ok(None);
    };
    let input = tempfile::Builder::new()
        .suffix(".json")
        .tempfile()
        .context("a temporary file for the OpenAPI document")?;
    std::fs::write(input.path(), openapi).context("writing the OpenAPI document")?;
    let output = Command::new(&generator)
        .arg(input.path())
        .current_dir(root.join(PACKAGE))
        .output()
        .with_context(|| format!("running {}", generator.display()))?;
    if !output.status.success() {
        bail!(
            "openapi-typescript failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    String::from_utf8(output.stdout)
        .map(Some)
        .context("openapi-typescript wrote something that is not UTF-8")
}
