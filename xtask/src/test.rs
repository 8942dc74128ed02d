//! `cargo xtask test`: every test Keel has, in one command (the README's and CI's).
//!
//! `cargo test --workspace` first; then the suites that need a feature the workspace
//! build leaves off (the OpenTelemetry export, feature `otlp`), each built with it; then
//! the Node suites against the `keel` binary just built: the TypeScript client's
//! (`npm test` in `clients/typescript`) and the web console's in Chromium (`npm test` in
//! `console`). They need Node 20+ and `npm ci` in each package (the console's also a
//! Chromium, `/usr/bin/chromium` or KEEL_CHROMIUM): without them the task says which
//! tests were skipped, and fails in CI. Extra arguments go to every
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
    let suites = [
        (
            "the TypeScript client",
            crate::typescript::PACKAGE,
            crate::typescript::INSTALL,
        ),
        (
            "the web console (in Chromium)",
            crate::console::PACKAGE,
            crate::console::INSTALL,
        ),
    ];
    let mut built = false;
    for (what, package, install) in suites {
        node_suite(root, &cargo, &mut built, what, package, install)?;
    }
    Ok(())
}

/// `npm test` in the Node package `package`, against a freshly built `keel` (built once,
/// on the first suite that runs).
fn node_suite(
    root: &Path,
    cargo: &str,
    built: &mut bool,
    what: &str,
    package: &str,
    install: &str,
) -> Result<()> {
    eprintln!("\n=== cargo xtask test: {what}");
    let package = root.join(package);
    let node = Command::new("node").arg("--version").output();
    let missing = match &node {
        Err(_) => Some("Node is not installed".to_owned()),
        Ok(out) if !node_is_recent(&String::from_utf8_lossy(&out.stdout)) => Some(format!(
            "Node {} is older than 20",
            String::from_utf8_lossy(&out.stdout).trim()
        )),
        Ok(_) if !package.join("node_modules").exists() => Some(install.to_owned()),
        Ok(_) => None,
    };
    if let Some(why) = missing {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            bail!("the tests of {what} cannot run: {why}");
        }
        eprintln!("note: the tests of {what} were SKIPPED: {why}");
        return Ok(());
    }
    if !*built {
        let status = Command::new(cargo)
            .current_dir(root)
            .args(["build", "--package", "keel-core", "--bin", "keel"])
            .status()?;
        if !status.success() {
            bail!("building keel for the Node tests failed ({status})");
        }
        *built = true;
    }
    let status = Command::new("npm")
        .current_dir(&package)
        .args(["test"])
        .env("KEEL_BINARY", root.join("target/debug/keel"))
        .status()?;
    if !status.success() {
        bail!("the tests of {what} failed ({status})");
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
