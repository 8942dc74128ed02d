//! `cargo xtask bench --peers`: Keel's long run side by side with peer systems running the
//! same workload, measured in one run.
//!
//! The workload is one session of N steps in which the model calls a file-write tool once,
//! then gives a final text answer (N = 100 and 1,000; `--quick`: 100 only), each system at
//! its default durability. The systems take turns (Keel, then each peer, round after
//! round) so that all of them see the same machine load; a figure is the median of its
//! rounds, and a ratio is the peer's median over Keel's from the same rounds.
//!
//! - Keel: the runner benchmark's long run (`--only long --backend full`), its binary built
//!   once and run once per round. It times `Runner::run` in-process with a scripted model.
//! - salvor 0.10.0 (`cargo install salvor-cli`): `salvor run --fixture DIR`, its offline
//!   mode, timed as a whole process. salvor serves the fixture's scripted model itself over
//!   loopback HTTP; the write tool is `save_claim` of `salvor-hero-tools`, the MCP server
//!   salvor-cli ships for its own fixture, spoken to over stdio.
//! - opencode 1.18.33 (npm `opencode-ai`): one session through the HTTP API of
//!   `opencode serve`, calling its builtin `write` tool, with an OpenAI-compatible model
//!   faked here on loopback.
//!
//! The peers are installed on demand under `target/peers/`; the option is run by hand,
//! never in CI. A peer that cannot be installed or cannot run the workload gets a note
//! saying why in place of its figures, and the others go on.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::{cargo, figures_from};

const SALVOR: &str = "0.10.0";
const OPENCODE: &str = "1.18.33";

/// Write steps per session, one figure each; `--quick` measures the first only.
const STEPS: &[usize] = &[100, 1_000];
const ROUNDS: usize = 3;

/// The prompt of every session, Keel's runner benchmark's own.
const PROMPT: &str = "Go on with the work.";

/// The steps of opencode's untimed first session: its first use installs a plugin from npm
/// in the background and loads its provider code.
const WARM_UP_STEPS: usize = 5;

/// How long one opencode step may take before the session counts as stuck: generous, as
/// opencode takes about a tenth of a second.
const OPENCODE_STEP_TIMEOUT: Duration = Duration::from_secs(1);

const KEEL_SETTINGS: &str = "synchronous=FULL, WAL (default); runner benchmark's long run: \
    Runner::run in-process, scripted model, builtin write";
const SALVOR_SETTINGS: &str = "synchronous=FULL, WAL (default); whole `salvor run --fixture` \
    process: its scripted model over loopback HTTP, MCP write tool over stdio, RUST_LOG=warn";
const OPENCODE_SETTINGS: &str = "synchronous=NORMAL, WAL (default); one session through \
    `opencode serve`'s HTTP API, fake OpenAI-compatible model streaming over loopback, \
    builtin write; permission allow, share/autoupdate/snapshot off";

/// One system of the comparison, able to run the workload.
trait System {
    /// Milliseconds per step of one session of `steps` write steps.
    fn per_step(&mut self, steps: usize) -> Result<f64>;
}

/// A system, or why it could not be set up, and what it measured.
struct Side {
    name: String,
    settings: &'static str,
    system: Result<Box<dyn System>, String>,
    samples: BTreeMap<usize, Vec<f64>>,
    /// Why a step count has no figure: its run failed, and is not tried again.
    failed: BTreeMap<usize, String>,
}

impl Side {
    fn new(name: String, settings: &'static str, system: Result<Box<dyn System>>) -> Self {
        let system = system.map_err(|e| {
            let why = format!("{e:#}");
            eprintln!("{name} cannot run: {why}");
            why
        });
        Self {
            name,
            settings,
            system,
            samples: BTreeMap::new(),
            failed: BTreeMap::new(),
        }
    }

    /// Runs one session of `steps` steps, recording its time or why it failed.
    fn measure(&mut self, steps: usize) {
        let Ok(system) = &mut self.system else {
            return;
        };
        if self.failed.contains_key(&steps) {
            return;
        }
        match system.per_step(steps) {
            Ok(ms) => {
                eprintln!("  {}, {steps} write steps: {ms:.3} ms/step", self.name);
                self.samples.entry(steps).or_default().push(ms);
            }
            Err(e) => {
                let why = format!("the {steps}-step session failed: {e:#}");
                eprintln!("  {}: {why}", self.name);
                self.failed.insert(steps, why);
            }
        }
    }

    /// The samples of `steps`, or why there are none.
    fn outcome(&self, steps: usize) -> Result<&[f64], String> {
        if let Err(why) = &self.system {
            return Err(why.clone());
        }
        if let Some(why) = self.failed.get(&steps) {
            return Err(why.clone());
        }
        self.samples
            .get(&steps)
            .map(Vec::as_slice)
            .ok_or_else(|| "not measured".to_owned())
    }
}

/// Installs what is missing, runs the rounds, and returns the figures.
pub fn run(root: &Path, quick: bool) -> Result<Vec<Value>> {
    let peers = root.join("target").join("peers");
    let (steps, rounds) = if quick {
        (&STEPS[..1], 1)
    } else {
        (STEPS, ROUNDS)
    };
    let mut keel = Side::new(
        "Keel".to_owned(),
        KEEL_SETTINGS,
        Ok(Box::new(Keel::build(root)?)),
    );
    let mut others = vec![
        Side::new(
            format!("salvor {SALVOR}"),
            SALVOR_SETTINGS,
            Salvor::install(&peers).map(|s| Box::new(s) as Box<dyn System>),
        ),
        Side::new(
            format!("opencode {OPENCODE}"),
            OPENCODE_SETTINGS,
            Opencode::start(&peers).map(|o| Box::new(o) as Box<dyn System>),
        ),
    ];
    for round in 1..=rounds {
        eprintln!("peers: round {round} of {rounds}");
        for &n in steps {
            keel.measure(n);
            if let Some(why) = keel.failed.get(&n) {
                bail!("Keel's side failed: {why}");
            }
            for side in &mut others {
                side.measure(n);
            }
        }
    }
    let mut figures = Vec::new();
    for &n in steps {
        let keel_ms = median(keel.outcome(n).map_err(anyhow::Error::msg)?);
        figures.push(figure(
            &keel.name,
            n,
            Ok(keel_ms),
            "ms/step",
            rounds,
            keel.settings,
        ));
        for side in &others {
            let ms = side.outcome(n).map(median);
            let ratio = ms.clone().map(|ms| ms / keel_ms);
            figures.push(figure(&side.name, n, ms, "ms/step", rounds, side.settings));
            let name = format!("{} / Keel", side.name);
            let settings = "medians of the same interleaved rounds";
            figures.push(figure(&name, n, ratio, "x", rounds, settings));
        }
    }
    Ok(figures)
}

/// A figure of the table and `latest.json`: a value, or a note saying why there is none.
fn figure(
    name: &str,
    steps: usize,
    value: Result<f64, String>,
    unit: &str,
    runs: usize,
    settings: &str,
) -> Value {
    let mut figure = json!({
        "figure": format!("{name}, {steps} write steps"),
        "value": null,
        "unit": unit,
        "backend": "sqlite",
        "runs": 0,
        "settings": settings,
    });
    match value {
        Ok(value) => {
            figure["value"] = json!(rounded(value));
            figure["runs"] = json!(runs);
        }
        Err(note) => figure["note"] = json!(note),
    }
    figure
}

/// The benchmarks' rounding (`core/benches/common`): whole numbers from 100 up, else three
/// decimals.
fn rounded(value: f64) -> f64 {
    if value.abs() >= 100.0 {
        value.round()
    } else {
        (value * 1000.0).round() / 1000.0
    }
}

/// The nearest-rank median, as the benchmarks compute it.
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[(sorted.len() - 1) / 2]
}

fn per_step(elapsed: Duration, steps: usize) -> f64 {
    elapsed.as_secs_f64() * 1000.0 / steps as f64
}

/// Whether `binary --version` names `version`: an installed peer is reused.
fn has_version(binary: &Path, version: &str) -> bool {
    Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .any(|word| word == version)
        })
}

/// Keel's side: the runner benchmark, built once, one long run per session.
struct Keel {
    binary: PathBuf,
}

impl Keel {
    fn build(root: &Path) -> Result<Self> {
        eprintln!("building keel-core bench runner");
        let output = Command::new(cargo())
            .current_dir(root)
            .args(["bench", "--package", "keel-core", "--bench", "runner"])
            .args(["--no-run", "--message-format=json"])
            .stderr(Stdio::inherit())
            .output()
            .context("building the runner benchmark")?;
        if !output.status.success() {
            bail!("building the runner benchmark failed ({})", output.status);
        }
        let binary = String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .find(|message| {
                message["reason"] == "compiler-artifact"
                    && message["target"]["name"] == "runner"
                    && message["target"]["kind"]
                        .as_array()
                        .is_some_and(|kinds| kinds.iter().any(|kind| kind == "bench"))
            })
            .and_then(|message| message["executable"].as_str().map(PathBuf::from))
            .context("cargo did not name the runner benchmark's executable")?;
        Ok(Self { binary })
    }
}

impl System for Keel {
    fn per_step(&mut self, steps: usize) -> Result<f64> {
        // `--quick` makes the long run one session: the rounds here are its repeats.
        let output = Command::new(&self.binary)
            .args([
                "--quick",
                "--only",
                "long",
                "--backend",
                "full",
                "--long-steps",
            ])
            .arg(steps.to_string())
            .stderr(Stdio::inherit())
            .output()
            .context("running the runner benchmark")?;
        if !output.status.success() {
            bail!("the runner benchmark failed ({})", output.status);
        }
        let name = format!("{steps}-step run, one write call per step");
        figures_from(&output.stdout)?
            .into_iter()
            .find(|f| f["figure"] == name.as_str())
            .and_then(|f| f["value"].as_f64())
            .with_context(|| format!("the runner benchmark reported no `{name}`"))
    }
}

/// salvor, run as `salvor run --fixture DIR` on a fresh store per session.
struct Salvor {
    bin: PathBuf,
    fixtures: PathBuf,
}

impl Salvor {
    /// Installs salvor-cli (and the fixture servers it ships) into `target/peers/bin`
    /// unless that version is there already.
    fn install(peers: &Path) -> Result<Self> {
        let bin = peers.join("bin");
        if !has_version(&bin.join("salvor"), SALVOR) {
            eprintln!(
                "installing salvor-cli {SALVOR} into {} (a long build)",
                peers.display()
            );
            let status = Command::new(cargo())
                .args(["install", "salvor-cli", "--version", SALVOR, "--locked"])
                .arg("--root")
                .arg(peers)
                .status()
                .context("running cargo install salvor-cli")?;
            if !status.success() {
                bail!("`cargo install salvor-cli --version {SALVOR}` failed ({status})");
            }
        }
        Ok(Self {
            bin,
            fixtures: peers.join("salvor"),
        })
    }

    /// Writes the fixture directory of a `steps`-step session: the agent, its input, and
    /// the scripted model's turns. salvor picks a turn by the number of messages in the
    /// request (turn k carries 2k + 1), so turn k calls `save_claim` and turn `steps`
    /// answers.
    fn fixture(&self, steps: usize) -> Result<PathBuf> {
        let dir = self.fixtures.join(format!("fixture-{steps}"));
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let tools = self.bin.join("salvor-hero-tools");
        let agent = format!(
            "model = \"scripted\"\n\
             system_prompt = \"Record one claim per step, then answer.\"\n\
             \n\
             [llm]\n\
             # `salvor run --fixture` points this variable at the model it serves.\n\
             base_url_env = \"SALVOR_BENCH_BASE_URL\"\n\
             \n\
             [[mcp_servers]]\n\
             command = {:?}\n\
             effect_overrides = {{ save_claim = \"write\" }}\n",
            tools.display().to_string()
        );
        let turn = |k: usize, content: Value, stop: &str| {
            json!({
                "messages": 2 * k + 1,
                "response": {
                    "id": format!("msg_{k}"),
                    "model": "scripted",
                    "role": "assistant",
                    "content": content,
                    "stop_reason": stop,
                    "usage": { "input_tokens": 10, "output_tokens": 5 },
                },
            })
        };
        let mut turns: Vec<Value> = (0..steps)
            .map(|k| {
                let call = json!({
                    "type": "tool_use",
                    "id": format!("tu_{k}"),
                    "name": "save_claim",
                    "input": { "item": format!("step {k}") },
                });
                turn(k, json!([call]), "tool_use")
            })
            .collect();
        turns.push(turn(
            steps,
            json!([{ "type": "text", "text": "All done." }]),
            "end_turn",
        ));
        for (name, contents) in [
            ("agent.toml", agent),
            ("input.json", json!({ "item": PROMPT }).to_string()),
            ("model.json", json!({ "turns": turns }).to_string()),
        ] {
            let path = dir.join(name);
            fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(dir)
    }
}

impl System for Salvor {
    fn per_step(&mut self, steps: usize) -> Result<f64> {
        let fixture = self.fixture(steps)?;
        let run = tempfile::tempdir().context("a directory for the salvor run")?;
        let claims = run.path().join("claims.txt");
        let start = Instant::now();
        let output = Command::new(self.bin.join("salvor"))
            .arg("--store")
            .arg(run.path().join("salvor.db"))
            .arg("run")
            .arg("--fixture")
            .arg(&fixture)
            .env("RUST_LOG", "warn")
            .env("SALVOR_HERO_CLAIMS", &claims)
            .stdin(Stdio::null())
            .output()
            .context("running salvor")?;
        let elapsed = start.elapsed();
        if !output.status.success() {
            bail!(
                "salvor run failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        let written = fs::read_to_string(&claims).context("reading salvor's claims file")?;
        if written.lines().count() != steps {
            bail!(
                "salvor's write tool ran {} times, not {steps}",
                written.lines().count()
            );
        }
        Ok(per_step(elapsed, steps))
    }
}

/// opencode: a running `opencode serve` in an empty project directory, and its model.
struct Opencode {
    server: Server,
    model: FakeModel,
    project: tempfile::TempDir,
}

/// The `opencode serve` process, stopped when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        // Killed outright: its database holds nothing but this benchmark's sessions.
        drop(self.child.kill());
        drop(self.child.wait());
    }
}

impl Opencode {
    /// Installs opencode from npm unless that version is there already, starts its server
    /// and runs the untimed first session.
    ///
    /// Its data, configuration and caches live under `target/peers/opencode/home` (the XDG
    /// directories), so nothing of the user's own opencode is read or written; the project
    /// is an empty temporary directory holding only `opencode.json`.
    fn start(peers: &Path) -> Result<Self> {
        let home = peers.join("opencode");
        let os = match std::env::consts::OS {
            "macos" => "darwin",
            other => other,
        };
        let arch = match std::env::consts::ARCH {
            "x86_64" => "x64",
            "aarch64" => "arm64",
            other => other,
        };
        // The npm package installs the binary of this platform as a dependency.
        let binary = home
            .join("node_modules")
            .join(format!("opencode-{os}-{arch}"))
            .join("bin")
            .join("opencode");
        if !has_version(&binary, OPENCODE) {
            eprintln!("installing opencode-ai {OPENCODE} into {}", home.display());
            let status = Command::new("npm")
                .args(["install", &format!("opencode-ai@{OPENCODE}"), "--prefix"])
                .arg(&home)
                .status()
                .context("running npm install opencode-ai")?;
            if !status.success() {
                bail!("`npm install opencode-ai@{OPENCODE}` failed ({status})");
            }
            if !has_version(&binary, OPENCODE) {
                bail!(
                    "npm installed opencode-ai {OPENCODE}, but {} does not run as that version",
                    binary.display()
                );
            }
        }
        let model = FakeModel::start()?;
        let project = tempfile::tempdir().context("a project directory for opencode")?;
        let config = project.path().join("opencode.json");
        fs::write(&config, keel_codegen::pretty(&opencode_config(model.port)))
            .with_context(|| format!("writing {}", config.display()))?;
        let server = Server::start(&binary, &home, project.path())?;
        let mut opencode = Self {
            server,
            model,
            project,
        };
        eprintln!("opencode: an untimed first session of {WARM_UP_STEPS} steps");
        opencode
            .per_step(WARM_UP_STEPS)
            .context("the untimed first session")?;
        Ok(opencode)
    }
}

/// The project's `opencode.json`: one provider, the fake model through the bundled
/// `@ai-sdk/openai-compatible`, for both the main and the small model so that nothing
/// leaves loopback; every permission allowed (no question waits for a person); sharing,
/// auto-update and snapshots off. A context limit far above the workload keeps compaction
/// out of it.
fn opencode_config(model_port: u16) -> Value {
    json!({
        "$schema": "https://opencode.ai/config.json",
        "share": "disabled",
        "autoupdate": false,
        "snapshot": false,
        "permission": "allow",
        "model": "fake/fake",
        "small_model": "fake/fake",
        "provider": {
            "fake": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "fake",
                "options": {
                    "baseURL": format!("http://127.0.0.1:{model_port}/v1"),
                    "apiKey": "none",
                },
                "models": {
                    "fake": {
                        "name": "fake",
                        "tool_call": true,
                        "limit": { "context": 10_000_000, "output": 4096 },
                    },
                },
            },
        },
    })
}

impl Server {
    fn start(binary: &Path, home: &Path, project: &Path) -> Result<Self> {
        let xdg = home.join("home");
        let log_path = home.join("serve.log");
        let log = fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let mut child = Command::new(binary)
            .args(["serve", "--hostname", "127.0.0.1", "--port", "0"])
            .current_dir(project)
            .env("XDG_DATA_HOME", xdg.join("data"))
            .env("XDG_CONFIG_HOME", xdg.join("config"))
            .env("XDG_CACHE_HOME", xdg.join("cache"))
            .env("XDG_STATE_HOME", xdg.join("state"))
            // The model catalogue from models.dev is not needed with a custom provider,
            // and fetching it would leave loopback.
            .env("OPENCODE_DISABLE_MODELS_FETCH", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .context("starting opencode serve")?;
        let stdout = child.stdout.take().context("opencode's stdout")?;
        let mut server = Self {
            child,
            addr: String::new(),
        };
        let mut lines = BufReader::new(stdout);
        let mut line = String::new();
        while server.addr.is_empty() {
            line.clear();
            if lines
                .read_line(&mut line)
                .context("reading opencode's stdout")?
                == 0
            {
                bail!(
                    "opencode serve exited without saying where it listens (see {})",
                    log_path.display()
                );
            }
            if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://")) {
                server.addr = url.trim_start_matches("http://").to_owned();
            }
        }
        // Whatever else it prints is read and dropped, so that a full pipe never blocks it.
        std::thread::spawn(move || std::io::copy(&mut lines, &mut std::io::sink()));
        Ok(server)
    }

    /// One request over a fresh connection, and the JSON of the answer.
    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<Value> {
        let what = format!("opencode's answer to {method} {path}");
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut stream = TcpStream::connect(&self.addr)
            .with_context(|| format!("connecting to opencode at {}", self.addr))?;
        stream.set_read_timeout(Some(timeout))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )
        .with_context(|| format!("sending {method} {path} to opencode"))?;
        let mut reader = BufReader::new(stream);
        let head = Head::read(&mut reader)
            .with_context(|| format!("reading {what}"))?
            .with_context(|| format!("opencode closed the connection before {what}"))?;
        let content = if head.header("transfer-encoding") == Some("chunked") {
            read_chunked(&mut reader)
        } else {
            let mut content = vec![0; head.content_length()?];
            reader.read_exact(&mut content).map(|()| content)
        }
        .with_context(|| format!("reading {what}"))?;
        if head.start.split_whitespace().nth(1) != Some("200") {
            bail!(
                "{what} is `{}`: {}",
                head.start,
                String::from_utf8_lossy(&content)
            );
        }
        serde_json::from_slice(&content).with_context(|| format!("{what} is not JSON"))
    }
}

impl System for Opencode {
    fn per_step(&mut self, steps: usize) -> Result<f64> {
        let out = self.project.path().join("out.txt");
        if out.exists() {
            fs::remove_file(&out).with_context(|| format!("removing {}", out.display()))?;
        }
        self.model.script(steps, &out);
        let quick = Duration::from_secs(30);
        // An explicit title: otherwise opencode asks the model for one.
        let session = self.server.request(
            "POST",
            "/session",
            Some(json!({ "title": "keel bench" })),
            quick,
        )?;
        let id = session["id"]
            .as_str()
            .with_context(|| format!("opencode's new session has no id: {session}"))?
            .to_owned();
        let prompt = json!({
            "parts": [{ "type": "text", "text": PROMPT }],
            "model": { "providerID": "fake", "modelID": "fake" },
        });
        let timeout = Duration::from_secs(60) + OPENCODE_STEP_TIMEOUT * steps as u32;
        let start = Instant::now();
        // Answers once the session has run to its final answer.
        let answer = self.server.request(
            "POST",
            &format!("/session/{id}/message"),
            Some(prompt),
            timeout,
        )?;
        let elapsed = start.elapsed();
        let requests = self.model.requests();
        self.server
            .request("DELETE", &format!("/session/{id}"), None, quick)?;
        if answer["info"]["finish"] != "stop" || !answer["info"]["error"].is_null() {
            bail!(
                "opencode's session did not finish with its answer: {}",
                answer["info"]
            );
        }
        if requests != steps + 1 {
            bail!(
                "opencode asked the model {requests} times, not {}",
                steps + 1
            );
        }
        let written = fs::read_to_string(&out).context("reading the file opencode wrote")?;
        if written != format!("step {}\n", steps - 1) {
            bail!("opencode's last write left {written:?}");
        }
        Ok(per_step(elapsed, steps))
    }
}

/// The model opencode talks to: an OpenAI-compatible `/v1/chat/completions` on loopback
/// whose k-th request of a session is answered, as one server-sent event stream, with a
/// call of `write` while k is below the session's steps, and with the final answer after.
/// The requests are counted rather than read (a long session's requests carry the whole
/// conversation, and parsing them in this unoptimized build would cost opencode time); the
/// count and the written file are checked after the session.
struct FakeModel {
    port: u16,
    script: Arc<Mutex<Script>>,
}

#[derive(Default)]
struct Script {
    steps: usize,
    path: String,
    requests: usize,
}

impl FakeModel {
    fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the fake model's port")?;
        let port = listener.local_addr()?.port();
        let script = Arc::new(Mutex::new(Script::default()));
        let shared = Arc::clone(&script);
        // The listener lives as long as this process: one opencode server per bench run.
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let script = Arc::clone(&shared);
                std::thread::spawn(move || {
                    if let Err(e) = serve(stream, &script) {
                        eprintln!("the fake model failed a connection: {e:#}");
                    }
                });
            }
        });
        Ok(Self { port, script })
    }

    /// Starts the script of a session of `steps` writes to `path`.
    fn script(&self, steps: usize, path: &Path) {
        *self.script.lock().expect("the fake model's script") = Script {
            steps,
            path: path.display().to_string(),
            requests: 0,
        };
    }

    fn requests(&self) -> usize {
        self.script
            .lock()
            .expect("the fake model's script")
            .requests
    }
}

/// Answers the requests of one keep-alive connection until opencode closes it.
fn serve(stream: TcpStream, script: &Mutex<Script>) -> Result<()> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    while let Some(head) = Head::read(&mut reader)? {
        // Read, not parsed: see `FakeModel`.
        let mut body = vec![0; head.content_length()?];
        reader.read_exact(&mut body)?;
        if !head.start.starts_with("POST /v1/chat/completions ") {
            write!(
                writer,
                "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
            )?;
            continue;
        }
        let events = {
            let mut script = script.lock().expect("the fake model's script");
            let k = script.requests;
            script.requests += 1;
            completion(k, &script)
        };
        write!(
            writer,
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {}\r\n\r\n{events}",
            events.len()
        )?;
    }
    Ok(())
}

/// The event stream of the k-th answer of a session: a `write` call, or the final text.
fn completion(k: usize, script: &Script) -> String {
    let chunk = |delta: Value, finish: Option<&str>| {
        let mut chunk = json!({
            "id": format!("fake-{k}"),
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "fake",
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
        });
        if finish.is_some() {
            chunk["usage"] =
                json!({ "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15 });
        }
        format!("data: {chunk}\n\n")
    };
    let (delta, finish) = if k < script.steps {
        let arguments = json!({ "filePath": script.path, "content": format!("step {k}\n") });
        let call = json!({
            "index": 0,
            "id": format!("call_{k}"),
            "type": "function",
            "function": { "name": "write", "arguments": arguments.to_string() },
        });
        (
            json!({ "role": "assistant", "tool_calls": [call] }),
            "tool_calls",
        )
    } else {
        (
            json!({ "role": "assistant", "content": "All done." }),
            "stop",
        )
    };
    format!(
        "{}{}data: [DONE]\n\n",
        chunk(delta, None),
        chunk(json!({}), Some(finish))
    )
}

/// The start line and headers of an HTTP message.
struct Head {
    start: String,
    /// Names in lowercase.
    headers: Vec<(String, String)>,
}

impl Head {
    /// Reads a message's head; `None` when the connection closed before one began.
    fn read(reader: &mut impl BufRead) -> Result<Option<Self>> {
        let mut start = String::new();
        if reader.read_line(&mut start)? == 0 {
            return Ok(None);
        }
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                bail!("the connection closed inside a message's headers");
            }
            let line = line.trim_end();
            if line.is_empty() {
                let start = start.trim_end().to_owned();
                return Ok(Some(Self { start, headers }));
            }
            let (name, value) = line
                .split_once(':')
                .with_context(|| format!("a malformed header line {line:?}"))?;
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, value)| value.as_str())
    }

    /// The length of the body that follows, as `Content-Length` says.
    fn content_length(&self) -> Result<usize> {
        self.header("content-length")
            .context("a message without Content-Length")?
            .parse()
            .context("a malformed Content-Length")
    }
}

/// A body sent with `Transfer-Encoding: chunked`, as opencode sends its answers.
fn read_chunked(reader: &mut impl BufRead) -> std::io::Result<Vec<u8>> {
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let mut content = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let size = line.trim_end().split(';').next().unwrap_or_default();
        let size =
            usize::from_str_radix(size, 16).map_err(|_| invalid("a malformed chunk size"))?;
        let mut chunk = vec![0; size + 2];
        reader.read_exact(&mut chunk)?;
        if !chunk.ends_with(b"\r\n") {
            return Err(invalid("a chunk not ended by CRLF"));
        }
        if size == 0 {
            return Ok(content);
        }
        content.extend_from_slice(&chunk[..size]);
    }
}
