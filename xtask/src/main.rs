//! Keel's project tasks, run as `cargo xtask <task>`.
//!
//! - `regenerate`: writes every generated file (contracts, the Rust client's endpoint layer,
//!   the TypeScript client's types and the web console's build).
//! - `check`: fails, naming each file, when a generated file is stale, when the catalog and
//!   `contracts/events/` disagree, or when a published event version's schema changed.
//! - `bench [--quick] [--postgres] [--peers] [--only store|runner|stored|server|peers]`: runs the
//!   benchmarks (`--peers`: also salvor and opencode on the same workload, installed on
//!   demand under `target/peers/`), prints a table, writes `target/bench/latest.json`.
//! - `test [ARGS]`: every test, the workspace's and those behind optional features (see
//!   `test`); the README's test command.
//! - `crash [--iterations N] [--seed S] [--sessions M]`: kills a real `keel serve` at
//!   random moments under load and checks that nothing was lost or run twice.

mod bench;
mod console;
mod crash;
mod published;
mod test;
mod typescript;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use keel_codegen::{EVENTS_DIR, File, check, generate};

const USAGE: &str = "usage: cargo xtask <regenerate|check|test [ARGS]|bench [--quick] [--postgres] [--peers]|crash [--iterations N] [--seed S] [--sessions M]>";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("regenerate") => regenerate(&workspace_root()),
        Some("check") => run_check(&workspace_root()),
        Some("bench") => bench::run(&workspace_root(), &args[1..]),
        Some("crash") => crash::run(&workspace_root(), &args[1..]),
        Some("test") => test::run(&workspace_root(), &args[1..]),
        _ => Err(anyhow::anyhow!(USAGE)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one directory below the workspace root")
        .to_path_buf()
}

/// Writes every generated file whose contents changed, and removes event files that the
/// catalog no longer generates.
fn regenerate(root: &Path) -> Result<()> {
    let files = generate();
    let mut changed = 0;
    for file in &files {
        let path = root.join(&file.path);
        if fs::read_to_string(&path).ok().as_deref() == Some(file.contents.as_str()) {
            continue;
        }
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        fs::write(&path, &file.contents).with_context(|| format!("writing {}", file.path))?;
        println!("wrote {}", file.path);
        changed += 1;
    }
    for path in read_generated(root, &[])?.into_keys() {
        if !files.iter().any(|f| f.path == path) {
            fs::remove_file(root.join(&path)).with_context(|| format!("removing {path}"))?;
            println!("removed {path}");
            changed += 1;
        }
    }
    let openapi = contract(&files)?;
    match typescript::generate(root, &openapi.contents)? {
        Some(types) => {
            let path = root.join(typescript::GENERATED);
            if fs::read_to_string(&path).ok().as_deref() != Some(types.as_str()) {
                fs::write(&path, types)
                    .with_context(|| format!("writing {}", typescript::GENERATED))?;
                println!("wrote {}", typescript::GENERATED);
                changed += 1;
            }
        }
        None => bail!("{}; the other files are written", typescript::INSTALL),
    }
    // The console bundles the client's sources, so it is built after their types.
    let Some(built) = console::build(root)? else {
        bail!("{}; the other files are written", console::INSTALL);
    };
    for path in console::stale(root, &built) {
        let name = path.rsplit('/').next().unwrap_or(&path);
        let contents = &built.iter().find(|(n, _)| *n == name).context("built")?.1;
        fs::create_dir_all(root.join(console::DIST))?;
        fs::write(root.join(&path), contents).with_context(|| format!("writing {path}"))?;
        println!("wrote {path}");
        changed += 1;
    }
    println!(
        "{} generated files, {changed} changed",
        files.len() + 1 + built.len()
    );
    Ok(())
}

/// Reads the generated files present on disk: the given paths that exist, and every file
/// under `contracts/events/`.
fn read_generated(root: &Path, files: &[File]) -> Result<BTreeMap<String, String>> {
    let mut on_disk = BTreeMap::new();
    for file in files {
        match fs::read_to_string(root.join(&file.path)) {
            Ok(contents) => {
                on_disk.insert(file.path.clone(), contents);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("reading {}", file.path)),
        }
    }
    let dir = root.join(EVENTS_DIR);
    if dir.exists() {
        for entry in fs::read_dir(&dir).with_context(|| format!("listing {EVENTS_DIR}"))? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = format!("{EVENTS_DIR}/{name}");
            let contents =
                fs::read_to_string(entry.path()).with_context(|| format!("reading {path}"))?;
            on_disk.insert(path, contents);
        }
    }
    Ok(on_disk)
}

/// The generated OpenAPI document, which the TypeScript client's types come from.
fn contract(files: &[File]) -> Result<&File> {
    files
        .iter()
        .find(|f| f.path == "contracts/openapi.json")
        .context("the contract is among the generated files")
}

fn run_check(root: &Path) -> Result<()> {
    let files = generate();
    let on_disk = read_generated(root, &files)?;
    let mut problems = Vec::new();
    match published::read(root)? {
        published::Base::Found {
            name,
            files: published,
        } => {
            println!(
                "checking {} published event schemas from `{name}`",
                published.len()
            );
            problems.extend(check::published(&files, &published));
        }
        published::Base::Missing { name } => println!(
            "note: no `{name}` branch in this checkout, so the published-version check was \
             skipped (set KEEL_CONTRACTS_BASE to another ref to run it)"
        ),
    }
    problems.extend(check::stale(&files, &on_disk));
    problems.extend(check::index_agrees_with_files(&on_disk));
    let mut checked = files.len();
    let openapi = contract(&files)?;
    match typescript::generate(root, &openapi.contents)? {
        Some(types) => {
            checked += 1;
            let path = root.join(typescript::GENERATED);
            if fs::read_to_string(&path).ok().as_deref() != Some(types.as_str()) {
                problems.push(check::Problem {
                    path: typescript::GENERATED.into(),
                    message: "stale: it differs from what openapi-typescript generates from \
                              the contract; run `cargo xtask regenerate` and commit the result"
                        .into(),
                });
            }
        }
        None if std::env::var("CI").is_ok_and(|v| v == "true") => {
            problems.push(check::Problem {
                path: typescript::PACKAGE.into(),
                message: format!(
                    "{} (CI must check the TypeScript client)",
                    typescript::INSTALL
                ),
            });
        }
        None => println!("note: {}; its types were not checked", typescript::INSTALL),
    }
    match console::build(root)? {
        Some(built) => {
            checked += built.len();
            problems.extend(console::stale(root, &built).into_iter().map(|path| {
                check::Problem {
                    path,
                    message: "stale: it differs from a fresh build of console/; run \
                              `cargo xtask regenerate` and commit the result"
                        .into(),
                }
            }));
        }
        None if std::env::var("CI").is_ok_and(|v| v == "true") => {
            problems.push(check::Problem {
                path: console::PACKAGE.into(),
                message: format!("{} (CI must check the console's build)", console::INSTALL),
            });
        }
        None => println!("note: {}; its build was not checked", console::INSTALL),
    }
    if problems.is_empty() {
        println!("contracts are up to date ({checked} generated files)");
        return Ok(());
    }
    for problem in &problems {
        eprintln!("{problem}");
    }
    bail!("{} contract problem(s)", problems.len())
}
