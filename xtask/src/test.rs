//! `cargo xtask test`: every test Keel has, in one command (the README's and CI's).
//!
//! `cargo test --workspace` first; then the suites that need a feature the workspace
//! build leaves off (the OpenTelemetry export, feature `otlp`), each built with it; then
//! the TypeScript client's tests (`npm test` in `clients/typescript`, against the `keel`
//! binary just built), which need Node 20+ and `npm ci` there: without them the task
//! says the TypeScript tests were skipped, and fails in CI. Extra arguments go to every
//! `cargo test` (for example `-- --nocapture`). The output of each run is passed through
//! as it comes; the first failure stops the task with its status.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

/// The runs, in order: what they test, and the arguments to `cargo test`.
const RUNS: &[(&str, &[&str])] = &[
    ("the workspace", &["--workspace"]),
    (
        "the OTLP export (feature otlp)",
        &[
            "--package",
            "keel-core",
            "--features",
            "otlp",
            "--test",
            "otlp",
        ],
    ),
];

pub fn run(root: &Path, extra: &[String]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    for (what, args) in RUNS {
        eprintln!("\n=== cargo xtask test: {what}");
        let status = Command::new(&cargo)
            .current_dir(root)
            .arg("test")
            .args(*args)
            .args(extra)
            .status()?;
        if !status.success() {
            bail!("the tests of {what} failed ({status})");
        }
    }
    typescript(root, &cargo)
}

/// `npm test` in the TypeScript client, against a freshly built `keel`.
fn typescript(root: &Path, cargo: &str) -> Result<()> {
    eprintln!("\n=== cargo xtask test: the TypeScript client");
    let package = root.join(crate::typescript::PACKAGE);
    let node = Command::new("node").arg("--version").output();
    let missing = match &node {
        Err(_) => Some("Node is not installed".to_owned()),
        Ok(out) if !node_is_recent(&String::from_utf8_lossy(&out.stdout)) => Some(format!(
            "Node {} is older than 20",
            String::from_utf8_lossy(&out.stdout).trim()
        )),
        Ok(_) if !package.join("node_modules").exists() => Some(crate::typescript::INSTALL.into()),
        Ok(_) => None,
    };
    if let Some(why) = missing {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            bail!("the TypeScript client's tests cannot run: {why}");
        }
        eprintln!("note: the TypeScript client's tests were SKIPPED: {why}");
        return Ok(());
    }
    let built = Command::new(cargo)
        .current_dir(root)
        .args(["build", "--package", "keel-core", "--bin", "keel"])
        .status()?;
    if !built.success() {
        bail!("building keel for the TypeScript tests failed ({built})");
    }
    let status = Command::new("npm")
        .current_dir(&package)
        .args(["test"])
        .env("KEEL_BINARY", root.join("target/debug/keel"))
        .status()?;
    if !status.success() {
        bail!("the tests of the TypeScript client failed ({status})");
    }
    Ok(())
}

/// Whether `node --version`'s answer (`v20.11.0`) is Node 20 or later.
fn node_is_recent(version: &str) -> bool {
    version
        .trim()
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|major| major.parse::<u32>().ok())
        .is_some_and(|major| major >= 20)
}
