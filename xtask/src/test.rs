//! `cargo xtask test`: every test Keel has, in one command (the README's and CI's).
//!
//! `cargo test --workspace` first; then the suites that need a feature the workspace
//! build leaves off (the OpenTelemetry export, feature `otlp`), each built with it. Extra
//! arguments go to every `cargo test` (for example `-- --nocapture`). The output of each
//! run is passed through as it comes; the first failure stops the task with its status.

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
    Ok(())
}
