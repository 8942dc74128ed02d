//! `cargo xtask bench [--quick] [--postgres] [--peers] [--only store|runner|stored|server|peers]`:
//! runs Keel's benchmarks, prints one table, and writes it as JSON to
//! `target/bench/latest.json`.
//!
//! Every figure comes from a benchmark binary built (optimized) and run by `cargo bench`,
//! which prints one `BENCH {json}` line per figure:
//! - `core/benches/store.rs`: durable events per second, and the raw driver's ceiling;
//! - `core/benches/runner.rs`: the engine's cost per step, a long run, recovery;
//! - `core/benches/server.rs`: a real `keel serve` driven through keel-client: delta
//!   latency, fan-out, memory.
//!
//! Figures are medians over several runs; ratios between figures (Keel against the raw
//! driver) are measured in one process, so both sides see the same machine load.
//!
//! `--peers` adds Keel's long run against peer systems running the same workload, taking
//! turns in one run (see `peers`); they are installed on demand under `target/peers/`, so
//! the option is for a run by hand, not for CI. `--only peers` runs that comparison alone.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

mod peers;

const USAGE: &str = "usage: cargo xtask bench [--quick] [--postgres] [--peers] [--only store|runner|stored|server|peers]";

/// The in-process benchmark binaries: (package, bench target).
const BENCHES: &[(&str, &str)] = &[
    ("keel-core", "store"),
    ("keel-core", "runner"),
    ("keel-core", "stored"),
    ("keel-core", "server"),
];

struct Options {
    quick: bool,
    postgres: bool,
    peers: bool,
    only: Option<String>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut options = Options {
        quick: false,
        postgres: false,
        peers: false,
        only: None,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => options.quick = true,
            "--postgres" => options.postgres = true,
            "--peers" => options.peers = true,
            "--only" => {
                let part = args.next().context(USAGE)?;
                if !["store", "runner", "stored", "server", "peers"].contains(&part.as_str()) {
                    bail!(
                        "--only takes store, runner, stored, server or peers, not `{part}`\n{USAGE}"
                    );
                }
                options.peers |= part == "peers";
                options.only = Some(part.clone());
            }
            other => bail!("unknown option `{other}`\n{USAGE}"),
        }
    }
    Ok(options)
}

pub fn run(root: &Path, args: &[String]) -> Result<()> {
    let options = parse(args)?;
    let wanted = |part: &str| options.only.as_deref().is_none_or(|only| only == part);
    let mut figures: Vec<Value> = Vec::new();
    for (package, bench) in BENCHES {
        if wanted(bench) {
            figures.extend(in_process(root, package, bench, &options)?);
        }
    }
    if options.peers {
        figures.extend(peers::run(root, options.quick)?);
    }
    if figures.is_empty() {
        bail!("the benchmarks reported no figures");
    }
    print_table(&figures);
    let report = json!({
        "quick": options.quick,
        "postgres": options.postgres,
        "peers": options.peers,
        "machine": machine(),
        "time_unix": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
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

/// Runs one benchmark binary through `cargo bench` and collects its figures.
fn in_process(root: &Path, package: &str, bench: &str, options: &Options) -> Result<Vec<Value>> {
    eprintln!(
        "running {package} bench {bench}{}",
        if options.quick { " (quick)" } else { "" }
    );
    let mut command = Command::new(cargo());
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
    if options.quick {
        command.arg("--quick");
    }
    if options.postgres {
        command.arg("--postgres");
    }
    let output = command
        .output()
        .with_context(|| format!("running the {bench} benchmark"))?;
    if !output.status.success() {
        bail!("the {bench} benchmark failed ({})", output.status);
    }
    figures_from(&output.stdout)
}

/// The figures of a benchmark binary's output: its `BENCH {json}` lines.
fn figures_from(stdout: &[u8]) -> Result<Vec<Value>> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|line| line.strip_prefix("BENCH "))
        .map(|json| {
            serde_json::from_str(json)
                .with_context(|| format!("reading the benchmark line `{json}`"))
        })
        .collect()
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

fn print_table(figures: &[Value]) {
    let text = |v: &Value, key: &str| v[key].as_str().unwrap_or("").to_owned();
    let rows: Vec<[String; 6]> = figures
        .iter()
        .map(|f| {
            [
                text(f, "figure"),
                // A figure that could not be measured says why instead of its settings.
                f["note"]
                    .as_str()
                    .map_or_else(|| f["value"].to_string(), |_| "-".into()),
                text(f, "unit"),
                text(f, "backend"),
                f["runs"].to_string(),
                f["note"].as_str().map_or_else(
                    || text(f, "settings"),
                    |note| format!("not measured: {note}"),
                ),
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
    let memory_kib = fs::read_to_string("/proc/meminfo").ok().and_then(|info| {
        info.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<u64>().ok())
    });
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|r| r.trim().to_owned())
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    json!({
        "cpu": cpu,
        "cores": cores,
        "memory_kib": memory_kib,
        "os": std::env::consts::OS,
        "kernel": kernel,
    })
}
