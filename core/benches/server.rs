//! Benchmarks of the real server: `keel serve` (built with this benchmark, optimized) on a
//! temporary SQLite database (its defaults: synchronous=FULL, WAL), driven only through
//! keel-client from this process. Run through `cargo xtask bench`, which collects the
//! `BENCH {json}` lines this prints.
//!
//! - Delta to client: sessions stream text from a scripted model (one delta every few
//!   milliseconds, many deltas per text fragment, each fragment between its durable
//!   `text.started` and `text.ended`); one client follows each session's log with
//!   ephemeral events. A sample is the client's receive time minus the envelope's
//!   `time`, which is when the provider's event arrived in Keel (`runner::receive`), so
//!   it counts every commit and queue in front of the delta. `time` is whole
//!   milliseconds (truncated), so each sample overstates the latency by 0 to 1 ms.
//!   With it, the server's CPU time per delta received, the bound once the two cores
//!   are busy.
//! - Fan-out: many clients follow one session; the same samples, and the same for its
//!   durable events (whose `time` is stamped inside the writing transaction, so their
//!   latency includes the commit).
//! - Memory: the server's resident set (`VmRSS`) before and after creating idle sessions,
//!   and after each of them starts a step that streams and then waits inside the model.
//!
//! The clients run on the same two cores as the server, so every latency here includes
//! the cost of the clients themselves. `KEEL_BENCH_BINARY=path` measures another build
//! of `keel` with the same clients, for before-and-after pairs run alternately.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use common::{Backend, flags, median, percentile, report};
use futures::StreamExt;
use futures::future::try_join_all;
use keel_client::schema::api::{CreateSession, LogItem, PromptRequest};
use keel_client::schema::event::{DurableEvent, EphemeralEvent};
use keel_client::schema::id::SessionId;
use keel_client::schema::types::{Part, Phase};
use keel_client::{Client, LogOptions};
use keel_core::store::Synchronous;
use serde_json::json;
use tokio::sync::mpsc;

/// What the server runs with: its defaults.
const SERVER: Backend = Backend::Sqlite(Synchronous::Full);
const SETTINGS: &str = "keel serve";

struct Plan {
    runs: usize,
    /// Text deltas per streamed step, the model's pause before each, and how many of
    /// them make one text fragment (between its durable `text.started` and `text.ended`).
    deltas: usize,
    delta_gap_ms: u64,
    deltas_per_fragment: usize,
    /// Concurrent streaming sessions of the latency figures.
    concurrent: Vec<usize>,
    subscribers: usize,
    fanout_runs: usize,
    /// Sessions of the memory figures, and runs of each count.
    memory: Vec<(usize, usize)>,
    /// How long the memory figure's model waits mid-stream.
    hold_ms: u64,
}

fn main() {
    let (quick, _) = flags();
    // `--memory-sessions 10000` measures the memory figures alone, with those counts;
    // `--latency-sessions 100,10000` the streaming sessions' latency figures alone (with
    // `--deltas N` per step).
    let counts = |name: &str| -> Option<Vec<usize>> {
        common::option(name).map(|list| {
            list.split(',')
                .map(|n| n.trim().parse().expect("a list of session counts"))
                .collect()
        })
    };
    let only = Only {
        memory: counts("--memory-sessions"),
        latency: counts("--latency-sessions"),
    };
    // `KEEL_BENCH_BINARY` runs another build of `keel` instead (before and after a
    // change, say, with the same clients).
    let binary = std::env::var_os("KEEL_BENCH_BINARY").map_or_else(
        || env!("CARGO_BIN_EXE_keel").into(),
        std::path::PathBuf::from,
    );
    if let Err(e) = run(&binary, quick, only) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Figures measured alone, with their session counts.
struct Only {
    memory: Option<Vec<usize>>,
    latency: Option<Vec<usize>>,
}

fn run(binary: &Path, quick: bool, only: Only) -> Result<()> {
    let mut plan = if quick {
        Plan {
            runs: 3,
            deltas: 20,
            delta_gap_ms: 20,
            deltas_per_fragment: 10,
            concurrent: vec![1, 100],
            subscribers: 250,
            fanout_runs: 1,
            memory: vec![(250, 1)],
            hold_ms: 600_000,
        }
    } else {
        Plan {
            runs: 5,
            deltas: 40,
            delta_gap_ms: 20,
            deltas_per_fragment: 10,
            concurrent: vec![1, 100, 1_000],
            subscribers: 1_000,
            fanout_runs: 3,
            memory: vec![(100, 3), (1_000, 3), (10_000, 1)],
            hold_ms: 600_000,
        }
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    if let Some(counts) = only.memory {
        plan.memory = counts.into_iter().map(|n| (n, 1)).collect();
        return runtime.block_on(memory(binary, &plan));
    }
    if let Some(counts) = only.latency {
        plan.concurrent = counts;
        plan.fanout_runs = 0;
        // `--deltas N` streams longer steps, so that many sessions overlap though they
        // are prompted 64 at a time.
        if let Some(deltas) = common::option("--deltas") {
            plan.deltas = deltas.parse().context("--deltas takes a number")?;
        }
        return runtime.block_on(latency(binary, &plan));
    }
    runtime.block_on(async {
        latency(binary, &plan).await?;
        memory(binary, &plan).await
    })
}

/// A running `keel serve` in its own temporary directory; killed when dropped.
struct Keel {
    child: Child,
    client: Client,
    url: String,
    // Held so the server's stdout stays open for its life.
    _stdout: BufReader<ChildStdout>,
    dir: tempfile::TempDir,
}

impl Keel {
    fn start(binary: &Path, plan: &Plan) -> Result<Self> {
        let dir = tempfile::tempdir().context("creating a temporary directory")?;
        write_config(dir.path(), plan)?;
        let log = std::fs::File::create(dir.path().join("keel.log"))?;
        let mut child = Command::new(binary)
            .args(["serve", "--listen", "127.0.0.1:0", "--config", "keel.toml"])
            .args(["--db", "sqlite://keel.db"])
            .current_dir(dir.path())
            .env_remove("KEEL_TOKEN")
            .env_remove("KEEL_CONFIG")
            .env_remove("KEEL_DB")
            .env_remove("KEEL_LEASE_MS")
            .env_remove("KEEL_HEARTBEAT_MS")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .context("starting keel")?;
        let mut stdout = BufReader::new(child.stdout.take().context("keel's stdout")?);
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .context("reading where keel listens")?;
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .with_context(|| format!("keel did not say where it listens: {line:?}"))?;
        Ok(Self {
            client: Client::new(url)?,
            url: url.to_owned(),
            child,
            _stdout: stdout,
            dir,
        })
    }

    /// The server's resident set, in KiB.
    fn rss_kib(&self) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .context("reading the server's /proc status")?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .context("the server's status has no VmRSS")
    }

    /// The CPU time the server has used so far, user and system, in seconds. `/proc`
    /// counts it in clock ticks, which Linux reports at 100 a second on every platform.
    fn cpu_seconds(&self) -> Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))
            .context("reading the server's /proc stat")?;
        // The fields after the command name, which is in parentheses and may hold spaces:
        // utime and stime are the 14th and 15th of the line, the 12th and 13th here.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .context("the server's stat has no command name")?
            .1
            .split_whitespace()
            .collect();
        let ticks = |i: usize| -> Result<f64> {
            fields
                .get(i)
                .and_then(|t| t.parse::<f64>().ok())
                .context("the server's stat has no CPU times")
        };
        Ok((ticks(11)? + ticks(12)?) / 100.0)
    }

    async fn sessions(&self, model: &str, count: usize) -> Result<Vec<SessionId>> {
        let mut ids = Vec::with_capacity(count);
        let request = CreateSession {
            directory: Some(self.dir.path().display().to_string()),
            model: Some(model.to_owned()),
            ..CreateSession::default()
        };
        // Bounded batches: a thousand requests at once only measure the listen backlog.
        for batch in (0..count).collect::<Vec<_>>().chunks(64) {
            let created =
                try_join_all(batch.iter().map(|_| self.client.create_session(&request))).await?;
            ids.extend(created.into_iter().map(|s| s.id));
        }
        Ok(ids)
    }

    async fn prompt(&self, sessions: &[SessionId]) -> Result<()> {
        let request = PromptRequest {
            id: None,
            parts: vec![Part::Text {
                text: "Tell me about it.".into(),
            }],
            delivery: None,
            request_execution: None,
        };
        for batch in sessions.chunks(64) {
            try_join_all(batch.iter().map(|&id| self.client.prompt(id, &request))).await?;
        }
        Ok(())
    }
}

impl Drop for Keel {
    fn drop(&mut self) {
        // The server and its database are thrown away; how it ends does not matter.
        drop(self.child.kill());
        drop(self.child.wait());
    }
}

fn write_config(dir: &Path, plan: &Plan) -> Result<()> {
    let text = |t: String| json!({"type": "text", "text": t, "chunks": 1});
    let delay = |ms: u64| json!({"type": "delay", "ms": ms});
    // Fragments of many deltas, a gap before each delta: a durable `text.ended` and
    // `text.started` between fragments, as a model's answer interleaves text and calls.
    let mut streamed = Vec::new();
    let per = plan.deltas_per_fragment.max(1);
    for fragment in 0..plan.deltas.div_ceil(per) {
        let words: String = (0..per).map(|n| format!("w{fragment}.{n} ")).collect();
        streamed.push(delay(plan.delta_gap_ms));
        streamed.push(json!({
            "type": "text",
            "text": words,
            "chunks": per,
            "gap_ms": plan.delta_gap_ms,
        }));
    }
    let scripts = [
        ("stream", json!({"responses": [{"items": streamed}]})),
        (
            "hold",
            json!({"responses": [{"items": [
                text("Thinking it over.".into()),
                delay(plan.hold_ms),
                text("Done.".into()),
            ]}]}),
        ),
        (
            "quick",
            json!({"responses": [{"items": [text("Hello.".into())]}]}),
        ),
    ];
    let mut config = String::from("default_model = \"quick/scripted\"\n");
    for (name, script) in scripts {
        std::fs::write(dir.join(format!("{name}.json")), script.to_string())?;
        config.push_str(&format!(
            "[provider.{name}]\nkind = \"scripted\"\nscript = \"{name}.json\"\n"
        ));
    }
    std::fs::write(dir.join("keel.toml"), config)?;
    Ok(())
}

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// What one follower saw of one busy period.
#[derive(Default)]
struct Samples {
    /// Milliseconds from each text delta's publication to its arrival.
    deltas: Vec<f64>,
    /// Milliseconds from each live durable event's stamp to its arrival.
    durable: Vec<f64>,
    /// When each follower saw its first text delta and its execution settle (ms since
    /// the epoch): how many sessions streamed at once.
    spans: Vec<(f64, f64)>,
}

/// The most `spans` open at one moment.
fn most_at_once(spans: &[(f64, f64)]) -> usize {
    let mut edges: Vec<(f64, i32)> = spans
        .iter()
        .flat_map(|&(start, end)| [(start, 1), (end, -1)])
        .collect();
    // At equal times an end comes first: a span that ends as another starts is not both.
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut open, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        open += step;
        most = most.max(open);
    }
    usize::try_from(most).unwrap_or(0)
}

/// Follows `id`'s log with ephemeral events, says when it is synced, and records every
/// live event until the execution settles.
async fn follow(client: Client, id: SessionId, synced: mpsc::Sender<()>) -> Result<Samples> {
    let mut log = client.session_log_with(
        id,
        LogOptions {
            ephemeral: true,
            ..LogOptions::default()
        },
    );
    let mut samples = Samples::default();
    let mut live = false;
    let mut first_delta = None;
    while let Some(item) = log.next().await {
        match item? {
            LogItem::Synced(_) => {
                live = true;
                synced
                    .send(())
                    .await
                    .context("the run stopped waiting for its followers")?;
            }
            LogItem::Ephemeral(e) => {
                if let EphemeralEvent::TextDelta(_) = e.event {
                    let now = now_ms();
                    samples.deltas.push(now - e.time as f64);
                    first_delta.get_or_insert(now);
                }
            }
            LogItem::Durable(e) => {
                if live {
                    samples.durable.push(now_ms() - e.time as f64);
                }
                if let DurableEvent::ExecutionSettled(_) = e.event {
                    if let Some(first) = first_delta {
                        samples.spans.push((first, now_ms()));
                    }
                    return Ok(samples);
                }
            }
        }
    }
    bail!("the log of {id} ended before its execution settled")
}

/// One run: `followers` clients follow each of `sessions`, all of them are prompted at
/// once, and every sample is returned when every execution settled.
async fn streamed(keel: &Keel, sessions: &[SessionId], followers: usize) -> Result<Samples> {
    let total = sessions.len() * followers;
    let (synced_tx, mut synced_rx) = mpsc::channel(total);
    let mut tasks = Vec::with_capacity(total);
    for &id in sessions {
        for _ in 0..followers {
            tasks.push(tokio::spawn(follow(
                keel.client.clone(),
                id,
                synced_tx.clone(),
            )));
        }
    }
    drop(synced_tx);
    for _ in 0..total {
        synced_rx
            .recv()
            .await
            .context("a follower ended before it was synced")?;
    }
    keel.prompt(sessions).await?;
    let mut all = Samples::default();
    for task in tasks {
        let samples = tokio::time::timeout(Duration::from_secs(300), task)
            .await
            .context("a follower waited five minutes for its session to settle")???;
        all.deltas.extend(samples.deltas);
        all.durable.extend(samples.durable);
        all.spans.extend(samples.spans);
    }
    if all.deltas.is_empty() {
        bail!("no text delta arrived");
    }
    Ok(all)
}

/// The server's `keel_store_queue` gauge every 20 ms, until `stop`; a failed read is
/// left out.
async fn queue_samples(url: String, mut stop: tokio::sync::oneshot::Receiver<()>) -> Vec<f64> {
    let http = reqwest::Client::new();
    let mut samples = Vec::new();
    loop {
        tokio::select! {
            _ = &mut stop => return samples,
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        let Ok(response) = http.get(format!("{url}/metrics")).send().await else {
            continue;
        };
        let text = response.text().await.unwrap_or_default();
        if let Some(value) = text
            .lines()
            .find_map(|l| l.strip_prefix("keel_store_queue "))
            .and_then(|v| v.trim().parse::<f64>().ok())
        {
            samples.push(value);
        }
    }
}

/// Delta-to-client latency with 1 and with many streaming sessions, then fan-out to many
/// followers of one session, all on one server.
async fn latency(binary: &Path, plan: &Plan) -> Result<()> {
    let keel = Keel::start(binary, plan)?;
    let shape = format!(
        "{SETTINGS}, {} deltas {} ms apart per step, {} per text fragment; stamped when \
         the provider's event arrives",
        plan.deltas, plan.delta_gap_ms, plan.deltas_per_fragment
    );
    for &concurrent in &plan.concurrent {
        eprintln!("server: delta latency, {concurrent} streaming sessions");
        let (mut p50s, mut p99s) = (Vec::new(), Vec::new());
        let (mut queue_maxima, mut at_once, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..plan.runs {
            let sessions = keel.sessions("stream/scripted", concurrent).await?;
            let (stop, stopped) = tokio::sync::oneshot::channel();
            let sampling = tokio::spawn(queue_samples(keel.url.clone(), stopped));
            let cpu_before = keel.cpu_seconds()?;
            let samples = streamed(&keel, &sessions, 1).await;
            let cpu_used = keel.cpu_seconds()? - cpu_before;
            // The sampler is waiting for this; it cannot have gone.
            stop.send(()).ok();
            let queue = sampling.await.unwrap_or_default();
            let samples = samples?;
            p50s.push(median(&samples.deltas));
            p99s.push(percentile(&samples.deltas, 0.99));
            queue_maxima.push(queue.iter().copied().fold(0.0, f64::max));
            at_once.push(most_at_once(&samples.spans) as f64);
            cpu.push(cpu_used * 1e6 / samples.deltas.len().max(1) as f64);
        }
        let name = format!("delta to client, {concurrent} streaming session(s)");
        report(
            &format!("{name}, p50"),
            median(&p50s),
            "ms",
            SERVER,
            plan.runs,
            &shape,
        );
        report(
            &format!("{name}, p99"),
            median(&p99s),
            "ms",
            SERVER,
            plan.runs,
            &shape,
        );
        report(
            &format!("{concurrent} sessions prompted, most streaming at once"),
            median(&at_once),
            "sessions",
            SERVER,
            plan.runs,
            "from each session's first text delta to its execution settling",
        );
        report(
            &format!("writer queue with {concurrent} streaming session(s), most seen"),
            median(&queue_maxima),
            "writes",
            SERVER,
            plan.runs,
            "writes waiting as a batch began (`keel_store_queue`), read every 20 ms",
        );
        // The bound when the tail grows: the server's CPU for everything a delta brings
        // (reading it, its share of the commits, publishing and sending it).
        report(
            &format!("server CPU per delta received, {concurrent} streaming session(s)"),
            median(&cpu),
            "µs",
            SERVER,
            plan.runs,
            "user and system time of `keel serve` over the run, divided by the text \
             deltas its clients received",
        );
    }
    if plan.fanout_runs == 0 {
        return Ok(());
    }

    eprintln!("server: fan-out to {} followers", plan.subscribers);
    let (mut p50s, mut p99s, mut durable_p99s, mut per_follower) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..plan.fanout_runs {
        let sessions = keel.sessions("stream/scripted", 1).await?;
        let before = keel.rss_kib()?;
        let samples = streamed(&keel, &sessions, plan.subscribers).await?;
        let after = keel.rss_kib()?;
        p50s.push(median(&samples.deltas));
        p99s.push(percentile(&samples.deltas, 0.99));
        durable_p99s.push(percentile(&samples.durable, 0.99));
        per_follower.push((after.saturating_sub(before)) as f64 / plan.subscribers as f64);
    }
    let n = plan.subscribers;
    let runs = plan.fanout_runs;
    let fanout = format!("fan-out to {n} followers of one session");
    report(
        &format!("{fanout}, delta p50"),
        median(&p50s),
        "ms",
        SERVER,
        runs,
        &shape,
    );
    report(
        &format!("{fanout}, delta p99"),
        median(&p99s),
        "ms",
        SERVER,
        runs,
        &shape,
    );
    report(
        &format!("{fanout}, durable event p99"),
        median(&durable_p99s),
        "ms",
        SERVER,
        runs,
        &shape,
    );
    report(
        &format!("RSS after {n} followers finished, per follower"),
        median(&per_follower),
        "KiB",
        SERVER,
        runs,
        SETTINGS,
    );
    Ok(())
}

/// The server's resident set with no sessions, with many idle sessions, and with each of
/// them in the middle of a streaming step; a fresh server per run, for each count.
async fn memory(binary: &Path, plan: &Plan) -> Result<()> {
    let mut base = Vec::new();
    for &(n, runs) in &plan.memory {
        let (mut idle, mut streaming) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            eprintln!("server: memory with {n} sessions");
            let keel = Keel::start(binary, plan)?;
            // One full prompt first, so what every process allocates once is not counted.
            let warm = keel.sessions("quick/scripted", 1).await?;
            streamed(&keel, &warm, 1).await?;
            let settle = || tokio::time::sleep(Duration::from_millis(500));
            settle().await;
            let empty = keel.rss_kib()?;
            let sessions = keel.sessions("hold/scripted", n).await?;
            settle().await;
            let with_idle = keel.rss_kib()?;
            keel.prompt(&sessions).await?;
            wait_running(&keel, &sessions).await?;
            settle().await;
            let with_streaming = keel.rss_kib()?;
            base.push(empty as f64 / 1024.0);
            idle.push(with_idle.saturating_sub(empty) as f64 / n as f64);
            streaming.push(with_streaming.saturating_sub(with_idle) as f64 / n as f64);
        }
        report(
            &format!("RSS per idle session, {n} sessions"),
            median(&idle),
            "KiB",
            SERVER,
            runs,
            SETTINGS,
        );
        report(
            &format!("RSS per streaming session, {n} at once"),
            median(&streaming),
            "KiB",
            SERVER,
            runs,
            &format!("{SETTINGS}, each step waits in the model after its first text"),
        );
    }
    report(
        "RSS of a started server",
        median(&base),
        "MiB",
        SERVER,
        base.len(),
        SETTINGS,
    );
    Ok(())
}

/// Waits until every session's execution is running its step.
async fn wait_running(keel: &Keel, sessions: &[SessionId]) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let mut waiting: Vec<SessionId> = sessions.to_vec();
    while !waiting.is_empty() {
        if tokio::time::Instant::now() > deadline {
            bail!(
                "{} sessions did not start their step in time",
                waiting.len()
            );
        }
        let mut still = Vec::new();
        for batch in waiting.chunks(64) {
            let statuses =
                try_join_all(batch.iter().map(|&id| keel.client.session_status(id))).await?;
            for (&id, status) in batch.iter().zip(statuses) {
                let running = status.execution.is_some_and(|e| e.phase == Phase::Running);
                if !running {
                    still.push(id);
                }
            }
        }
        waiting = still;
        if !waiting.is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}
