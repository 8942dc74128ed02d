//! Runner benchmarks: the engine's own cost per step, a long run of write steps, and
//! recovery of many abandoned sessions.
//!
//! Every figure goes through the full runner (coordinator, claim and fence, inbox
//! promotion, publisher, tool settlement, projections, the store's writer) with a
//! zero-latency scripted model, so what is measured is Keel, not a model. Run through
//! `cargo xtask bench`, which collects the `BENCH {json}` lines this prints.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Backend, Database, flags, median, option, percentile, report, runtime};
use diesel::RunQueryDsl;
use keel_core::event::log;
use keel_core::inbox::{self, Admission};
use keel_core::instructions::Instructions;
use keel_core::provider::Provider;
use keel_core::provider::scripted::{Item, Response, Script, Scripted};
use keel_core::recovery::Recovery;
use keel_core::runner::{Agent, Live, RetryPolicy, Runner, Settings};
use keel_core::store::{self, Store};
use keel_core::tool;
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::{CallId, OwnerId, SessionId};
use keel_schema::types::{Effect, ModelRef, Part};
use serde_json::json;

const LEASE_MS: i64 = 30_000;

struct Plan {
    runs: usize,
    /// Sessions per run of the per-step benchmark, each run one after another.
    step_sessions: usize,
    /// Text-and-read steps per session of the per-step benchmark.
    steps_per_session: usize,
    /// Write steps of the long runs, one figure each (`--long-steps 100,1000`).
    long_steps: Vec<usize>,
    long_runs: usize,
    /// Abandoned sessions recovered, one figure each.
    recoveries: Vec<usize>,
    recovery_runs: usize,
}

/// A runner on a fresh database with one scripted model, and a session directory.
struct Bench {
    store: Store,
    runner: Runner,
    workspace: tempfile::TempDir,
    _database: Database,
}

impl Bench {
    async fn new(backend: Backend, script: Script, max_steps: u32) -> Self {
        let database = Database::new(backend);
        let store = database.open().await;
        let mut agents = HashMap::new();
        agents.insert(
            "build".to_owned(),
            Agent {
                max_steps,
                permissions: keel_core::runner::Permissions::allow_all(),
                ..Agent::default()
            },
        );
        let mut providers: HashMap<String, Arc<dyn Provider>> = HashMap::new();
        providers.insert("scripted".into(), Arc::new(Scripted::new(script)));
        let runner = Runner::new(
            store.clone(),
            Settings {
                owner: OwnerId::new(),
                lease_ms: LEASE_MS,
                agents,
                providers,
                tools: tool::builtins(),
                limits: tool::Limits::default(),
                retry: RetryPolicy::default(),
                models: HashMap::new(),
                instructions: Instructions::none(),
                prices: HashMap::new(),
                mcp: Default::default(),
                protected: Default::default(),
            },
        );
        let workspace = tempfile::tempdir().unwrap();
        std::fs::write(
            workspace.path().join("notes.txt"),
            "A short file the model reads.\n".repeat(20),
        )
        .unwrap();
        Self {
            store,
            runner,
            workspace,
            _database: database,
        }
    }

    fn created(&self) -> DurableEvent {
        DurableEvent::Created(payload::Created {
            title: None,
            directory: self.workspace.path().to_string_lossy().into_owned(),
            agent: "build".into(),
            model: model(),
            metadata: None,
        })
    }

    /// A new session with one prompt admitted, not yet run.
    async fn prompted(&self) -> SessionId {
        let session = SessionId::new();
        let created = self.created();
        let clock = self.store.clock().clone();
        self.store
            .write(move |c| {
                let now = clock.now_ms();
                log::append(c, now, session, vec![created.clone()])?;
                inbox::admit(c, now, session, prompt()).map_err(|e| store_error(&e))?;
                Ok::<_, store::Error>(())
            })
            .await
            .unwrap();
        session
    }
}

fn model() -> ModelRef {
    ModelRef {
        provider: "scripted".into(),
        id: "bench".into(),
    }
}

fn prompt() -> Admission {
    Admission::prompt(vec![Part::Text {
        text: "Go on with the work.".into(),
    }])
}

fn store_error(e: &dyn std::fmt::Display) -> store::Error {
    store::Error::Corrupt(e.to_string())
}

fn text(t: &str) -> Item {
    Item::Text {
        text: t.into(),
        chunks: Some(3),
        gap_ms: None,
    }
}

fn call(name: &str, input: serde_json::Value) -> Item {
    Item::ToolCall {
        name: name.into(),
        input,
        raw: None,
        id: None,
    }
}

/// `steps` responses built by `step`, then a closing text.
fn script(steps: usize, step: impl Fn(usize) -> Vec<Item>) -> Script {
    let mut responses: Vec<Response> = (0..steps).map(|n| Response { items: step(n) }).collect();
    responses.push(Response {
        items: vec![text("All done.")],
    });
    Script { responses }
}

/// Per-step durations of one run: sessions one after another, each a prompt answered by
/// `steps` steps of text and a `read` call, then a closing text. A step's time is from
/// its `step.started` to the next one's, as the live stream delivers them: the provider
/// stream, the durable text and tool events, the tool, the step's end and the boundary.
async fn step_times(backend: Backend, plan: &Plan) -> Vec<f64> {
    let steps = plan.steps_per_session;
    let script = script(steps, |_| {
        vec![
            text("Reading the notes again."),
            call("read", json!({"path": "notes.txt"})),
        ]
    });
    let bench = Bench::new(backend, script, u32::try_from(steps + 1).unwrap()).await;
    let mut times = Vec::new();
    for _ in 0..plan.step_sessions {
        let session = bench.prompted().await;
        let mut live = bench.runner.subscribe();
        let watcher = tokio::spawn(async move {
            let mut starts = Vec::new();
            loop {
                match live.recv().await {
                    Ok(Live::Durable(e)) if e.session_id == session => match e.event {
                        DurableEvent::StepStarted(_) => starts.push(Instant::now()),
                        DurableEvent::ExecutionSettled(_) => return starts,
                        _ => {}
                    },
                    Ok(_) => {}
                    Err(e) => panic!("the live stream failed: {e}"),
                }
            }
        });
        bench.runner.run(session).await.unwrap();
        let starts = watcher.await.unwrap();
        assert_eq!(starts.len(), steps + 1, "every scripted step ran");
        times.extend(
            starts
                .windows(2)
                .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1000.0),
        );
    }
    times
}

/// Milliseconds per step of one session running `steps` steps of one `write` call each,
/// and the writer's syncs (commits that waited for the disk, and syncs of deferred ones)
/// per step.
async fn long_run(backend: Backend, steps: usize) -> (f64, f64) {
    let script = script(steps, |n| {
        vec![call(
            "write",
            json!({"path": "out.txt", "content": format!("step {n}\n")}),
        )]
    });
    let bench = Bench::new(backend, script, u32::try_from(steps + 1).unwrap()).await;
    let session = bench.prompted().await;
    let syncs = bench.store.syncs();
    let start = Instant::now();
    bench.runner.run(session).await.unwrap();
    let elapsed = start.elapsed();
    let syncs = bench.store.syncs() - syncs;
    let written = std::fs::read_to_string(bench.workspace.path().join("out.txt")).unwrap();
    assert_eq!(written, format!("step {}\n", steps - 1), "every step wrote");
    (
        elapsed.as_secs_f64() * 1000.0 / steps as f64,
        syncs as f64 / steps as f64,
    )
}

/// Writes `count` sessions whose owner died mid-step: each has a prompt promoted, a claim
/// in phase `running` whose lease ran out, an open step that streamed text, and a `write`
/// call running. This is what a SIGKILL leaves.
async fn abandon(bench: &Bench, count: usize) {
    let dead = OwnerId::new();
    let created = bench.created();
    let mut left = count;
    while left > 0 {
        let chunk = left.min(250);
        left -= chunk;
        let created = created.clone();
        let clock = bench.store.clock().clone();
        bench
            .store
            .write(move |c| {
                let then = clock.now_ms() - 2 * LEASE_MS;
                for _ in 0..chunk {
                    abandon_one(c, then, dead, created.clone())?;
                }
                Ok::<_, store::Error>(())
            })
            .await
            .unwrap();
    }
}

fn abandon_one(
    c: &mut store::Conn,
    then: i64,
    dead: OwnerId,
    created: DurableEvent,
) -> Result<(), store::Error> {
    let (session, _, assistant) =
        common::start_first_step(c, then, LEASE_MS, dead, created, prompt(), model())?;
    log::append(
        c,
        then,
        session,
        vec![
            DurableEvent::TextStarted(payload::TextStarted {
                assistant_message_id: assistant,
                ordinal: 0,
            }),
            DurableEvent::TextEnded(payload::TextEnded {
                assistant_message_id: assistant,
                ordinal: 0,
                text: "Writing the file.".into(),
            }),
            DurableEvent::ToolCalled(payload::ToolCalled {
                assistant_message_id: assistant,
                call_id: CallId::new(),
                name: "write".into(),
                input: json!({"path": "out.txt", "content": "lost\n"}),
                provider_executed: false,
                effect: Effect::Write,
                provider_call_id: None,
                rerun: false,
            }),
        ],
    )?;
    Ok(())
}

/// The `n` a plain SQL count query returns: a benchmark's probe.
async fn count_rows(store: &Store, sql: &'static str) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    store
        .read(move |c| {
            diesel::sql_query(sql)
                .get_result::<Count>(c)
                .map(|r| r.n)
                .map_err(store::Error::from)
        })
        .await
        .unwrap()
}

/// Seconds until every one of `count` abandoned sessions is recovered (its execution
/// settled, its continuation admitted and the session woken), and until all of them have
/// run their continuation and are idle again. Passes run back to back, as fast as the
/// recovery code goes; the server spaces them by half a lease.
async fn recovery(backend: Backend, count: usize) -> (f64, f64) {
    let script = Script {
        responses: vec![Response {
            items: vec![text("Continuing after the restart.")],
        }],
    };
    let bench = Bench::new(backend, script, 50).await;
    abandon(&bench, count).await;
    let start = Instant::now();
    let mut recovery = Recovery::default();
    let mut recovered = 0;
    while recovered < count {
        let report = recovery.pass(&bench.runner).await.unwrap();
        assert!(
            report.quarantined.is_empty() && report.exhausted.is_empty(),
            "every abandoned session is valid: {report:?}"
        );
        if report.recovered.is_empty() {
            panic!(
                "a pass recovered nothing with {} sessions left",
                count - recovered
            );
        }
        recovered += report.recovered.len();
    }
    let resumed = start.elapsed().as_secs_f64();
    loop {
        let claims = count_rows(&bench.store, "SELECT COUNT(*) AS n FROM session_execution").await;
        let pending = count_rows(
            &bench.store,
            "SELECT COUNT(*) AS n FROM session_input \
             WHERE promoted_seq IS NULL AND cancelled_seq IS NULL",
        )
        .await;
        if claims == 0 && pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let idle = start.elapsed().as_secs_f64();
    let settled = count_rows(
        &bench.store,
        "SELECT COUNT(*) AS n FROM event WHERE type = 'session.next.step.ended'",
    )
    .await;
    assert_eq!(settled, count as i64, "every continuation ran one step");
    (resumed, idle)
}

fn main() {
    let (quick, postgres) = flags();
    let mut plan = if quick {
        Plan {
            runs: 3,
            step_sessions: 3,
            steps_per_session: 20,
            long_steps: vec![200],
            long_runs: 1,
            recoveries: vec![1_000],
            recovery_runs: 1,
        }
    } else {
        Plan {
            runs: 5,
            step_sessions: 10,
            steps_per_session: 20,
            long_steps: vec![100, 1_000, 10_000],
            long_runs: 3,
            recoveries: vec![1_000, 10_000],
            recovery_runs: 3,
        }
    };
    // `--only steps|long|recovery` runs one part, for profiling it.
    let only = option("--only");
    if let Some(list) = option("--long-steps") {
        plan.long_steps = list
            .split(',')
            .map(|n| {
                n.trim()
                    .parse()
                    .expect("--long-steps takes numbers, e.g. 100,1000")
            })
            .collect();
    }
    let wanted = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let runtime = runtime();
    for backend in Backend::chosen(postgres) {
        if !wanted("steps") {
            break;
        }
        let mut p50s = Vec::new();
        let mut p99s = Vec::new();
        for _ in 0..plan.runs {
            let times = runtime.block_on(step_times(backend, &plan));
            p50s.push(median(&times));
            p99s.push(percentile(&times, 0.99));
        }
        let shape = format!(
            "{} steps of text + read per session, {} sessions per run",
            plan.steps_per_session, plan.step_sessions
        );
        report(
            "engine overhead per step, median",
            median(&p50s),
            "ms",
            backend,
            plan.runs,
            &shape,
        );
        report(
            "engine overhead per step, p99",
            median(&p99s),
            "ms",
            backend,
            plan.runs,
            &shape,
        );
    }
    for backend in Backend::chosen(postgres) {
        if !wanted("long") {
            break;
        }

        for &steps in &plan.long_steps {
            let (per_step, syncs): (Vec<f64>, Vec<f64>) = (0..plan.long_runs)
                .map(|_| runtime.block_on(long_run(backend, steps)))
                .unzip();
            report(
                &format!("{steps}-step run, one write call per step"),
                median(&per_step),
                "ms/step",
                backend,
                plan.long_runs,
                "",
            );
            report(
                &format!("{steps}-step run, syncs per step"),
                median(&syncs),
                "syncs/step",
                backend,
                plan.long_runs,
                "commits that waited for the disk, and syncs of deferred commits",
            );
        }
    }
    // Recovery is measured at Keel's default durability (and on PostgreSQL when asked).
    let mut backends = vec![Backend::Sqlite(store::Synchronous::Full)];
    if postgres {
        backends.push(Backend::Postgres);
    }
    for backend in backends {
        if !wanted("recovery") {
            break;
        }
        for &count in &plan.recoveries {
            let runs: Vec<(f64, f64)> = (0..plan.recovery_runs)
                .map(|_| runtime.block_on(recovery(backend, count)))
                .collect();
            let settings = "passes back to back";
            report(
                &format!("recovery of {count} abandoned sessions, all resumed"),
                median(&runs.iter().map(|r| r.0).collect::<Vec<_>>()),
                "s",
                backend,
                plan.recovery_runs,
                settings,
            );
            report(
                &format!("recovery of {count} abandoned sessions, all idle again"),
                median(&runs.iter().map(|r| r.1).collect::<Vec<_>>()),
                "s",
                backend,
                plan.recovery_runs,
                settings,
            );
        }
    }
}
