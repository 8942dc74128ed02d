//! `cargo xtask bench [--quick]`: runs Keel's benchmarks, prints one table, and writes it
//! as JSON to `target/bench/latest.json`.
//!
//! Each benchmark binary prints one `BENCH {json}` line per figure; this collects them.
//! Figures are medians over several runs measured in one process, so ratios between them
//! (Keel against the raw driver) are taken under the same machine load.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// The benchmark binaries: (package, bench target).
const BENCHES: &[(&str, &str)] = &[("keel-core", "store")];

pub fn run(root: &Path, args: &[String]) -> Result<()> {
    let mut quick = false;
    for arg in args {
        match arg.as_str() {
            "--quick" => quick = true,
            "--postgres" => bail!(
                "PostgreSQL benchmarks are not built yet; `cargo xtask bench` measures SQLite"
            ),
            other => bail!("unknown option `{other}`; usage: cargo xtask bench [--quick]"),
        }
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut figures: Vec<Value> = Vec::new();
    for (package, bench) in BENCHES {
        eprintln!(
            "running {package} bench {bench}{}",
            if quick { " (quick)" } else { "" }
        );
        let mut command = Command::new(&cargo);
        command
            .current_dir(root)
            .args([
                "bench",
                "--quiet",
                "--package",
                package,
                "--bench",
                bench,
                "--",
            ])
            .stderr(Stdio::inherit());
        if quick {
            command.arg("--quick");
        }
        let output = command
            .output()
            .with_context(|| format!("running the {bench} benchmark"))?;
        if !output.status.success() {
            bail!("the {bench} benchmark failed ({})", output.status);
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        for line in stdout.lines() {
            if let Some(json) = line.strip_prefix("BENCH ") {
                figures.push(
                    serde_json::from_str(json)
                        .with_context(|| format!("reading the benchmark line `{line}`"))?,
                );
            }
        }
    }
    if figures.is_empty() {
        bail!("the benchmarks reported no figures");
    }
    print_table(&figures);
    let report = json!({
        "quick": quick,
        "machine": machine(),
        "figures": figures,
    });
    let dir = root.join("target").join("bench");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("latest.json");
    fs::write(&path, keel_codegen::pretty(&report))
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn print_table(figures: &[Value]) {
    let text = |v: &Value, key: &str| v[key].as_str().unwrap_or("").to_owned();
    let rows: Vec<[String; 6]> = figures
        .iter()
        .map(|f| {
            [
                text(f, "figure"),
                f["value"].to_string(),
                text(f, "unit"),
                text(f, "backend"),
                f["runs"].to_string(),
                text(f, "settings"),
            ]
        })
        .collect();
    let header = ["figure", "value", "unit", "backend", "runs", "settings"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (cell, width))| {
                if i == 1 || i == 4 {
                    format!("{cell:>width$}")
                } else {
                    format!("{cell:<width$}")
                }
            })
            .collect();
        println!("{}", cells.join("  ").trim_end());
    }
}

/// What the numbers were measured on.
fn machine() -> Value {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    json!({"cpu": cpu, "cores": cores, "os": std::env::consts::OS})
}
