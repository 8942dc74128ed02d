//! Prometheus metrics: what the process counted since it started, rendered in the text
//! exposition format by `GET /metrics` (docs/operations.md lists them).
//!
//! The counters are the process's own (one registry per process, like the log): each
//! node of a cluster is scraped on its own and the sums are taken in Prometheus. Gauges
//! of the shared state (sessions by state, nodes seen) are read from the database when
//! the page is rendered, so every node reports the same values for them.

use std::sync::LazyLock;
use std::time::Duration;

use keel_schema::event::DurableEvent;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label pairs of a metric.
type Labels = Vec<(&'static str, String)>;

/// Every metric the process keeps.
pub struct Metrics {
    registry: Registry,
    executions_started: Counter,
    executions_settled: Family<Labels, Counter>,
    steps: Family<Labels, Counter>,
    step_seconds: Histogram,
    provider_requests: Family<Labels, Counter>,
    provider_first_token_seconds: Family<Labels, Histogram>,
    provider_tokens: Family<Labels, Counter>,
    tool_calls: Family<Labels, Counter>,
    tool_seconds: Family<Labels, Histogram>,
    store_commits: Counter,
    store_commit_seconds: Histogram,
    store_batch_writes: Histogram,
    store_queue: Gauge,
    store_stale_reruns: Counter,
    recovery_passes: Counter,
    recovery_claims: Family<Labels, Counter>,
    stream_subscribers: Gauge,
    stream_lagged: Counter,
    sessions: Family<Labels, Gauge>,
    nodes: Gauge,
}

/// Seconds from 1 ms to about 9 minutes.
fn seconds() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

fn seconds_family() -> Family<Labels, Histogram> {
    Family::new_with_constructor(seconds)
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("keel");
        let metrics = Self {
            executions_started: Counter::default(),
            executions_settled: Family::default(),
            steps: Family::default(),
            step_seconds: seconds(),
            provider_requests: Family::default(),
            provider_first_token_seconds: seconds_family(),
            provider_tokens: Family::default(),
            tool_calls: Family::default(),
            tool_seconds: seconds_family(),
            store_commits: Counter::default(),
            store_commit_seconds: seconds(),
            store_batch_writes: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
            store_queue: Gauge::default(),
            store_stale_reruns: Counter::default(),
            recovery_passes: Counter::default(),
            recovery_claims: Family::default(),
            stream_subscribers: Gauge::default(),
            stream_lagged: Counter::default(),
            sessions: Family::default(),
            nodes: Gauge::default(),
            registry: Registry::default(),
        };
        let m = &metrics;
        registry.register(
            "executions_started",
            "Executions (busy periods) this process started",
            m.executions_started.clone(),
        );
        registry.register(
            "executions_settled",
            "Executions settled, by outcome",
            m.executions_settled.clone(),
        );
        registry.register(
            "steps",
            "Steps ended, by how (ended, failed, interrupted, awaiting, recovered)",
            m.steps.clone(),
        );
        registry.register(
            "step_seconds",
            "How long a step ran, from its start to its end",
            m.step_seconds.clone(),
        );
        registry.register(
            "provider_requests",
            "Model requests, by provider, model and outcome (ok or the error's type)",
            m.provider_requests.clone(),
        );
        registry.register(
            "provider_first_token_seconds",
            "Time from sending a model request to its first streamed event, by provider",
            m.provider_first_token_seconds.clone(),
        );
        registry.register(
            "provider_tokens",
            "Tokens the providers reported, by provider, model and kind",
            m.provider_tokens.clone(),
        );
        registry.register(
            "tool_calls",
            "Local tool calls run, by tool and outcome (ok or the error's type)",
            m.tool_calls.clone(),
        );
        registry.register(
            "tool_seconds",
            "How long a tool call ran, by tool",
            m.tool_seconds.clone(),
        );
        registry.register(
            "store_commits",
            "Transactions the writer committed",
            m.store_commits.clone(),
        );
        registry.register(
            "store_commit_seconds",
            "How long a write batch took, from its first write to its commit",
            m.store_commit_seconds.clone(),
        );
        registry.register(
            "store_batch_writes",
            "Writes per committed transaction (group commit)",
            m.store_batch_writes.clone(),
        );
        registry.register(
            "store_queue",
            "Writes waiting for the writer",
            m.store_queue.clone(),
        );
        registry.register(
            "store_stale_reruns",
            "Write batches run again for a session counter remembered from an earlier batch that had moved, or might have (PostgreSQL)",
            m.store_stale_reruns.clone(),
        );
        registry.register(
            "recovery_passes",
            "Recovery passes run",
            m.recovery_passes.clone(),
        );
        registry.register(
            "recovery_claims",
            "Abandoned claims handled, by result (recovered or quarantined)",
            m.recovery_claims.clone(),
        );
        registry.register(
            "stream_subscribers",
            "Open event streams (session logs and the all-sessions stream)",
            m.stream_subscribers.clone(),
        );
        registry.register(
            "stream_lagged",
            "Event-stream subscribers disconnected for falling behind",
            m.stream_lagged.clone(),
        );
        registry.register(
            "sessions",
            "Sessions not deleted, by state (idle, busy, waiting for a person), from the database",
            m.sessions.clone(),
        );
        registry.register(
            "nodes",
            "Keel processes seen on the database within three leases",
            m.nodes.clone(),
        );
        Self {
            registry,
            ..metrics
        }
    }
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

fn m() -> &'static Metrics {
    &METRICS
}

/// Counts what committed events say: executions started and settled, steps ended.
/// Called with this process's own commits only (never with another node's), so each
/// event is counted once in the cluster.
pub fn committed<'a>(events: impl IntoIterator<Item = &'a DurableEvent>) {
    let metrics = m();
    for event in events {
        let step = |how: &str| {
            metrics
                .steps
                .get_or_create(&vec![("end", how.to_owned())])
                .inc();
        };
        match event {
            DurableEvent::ExecutionStarted(_) => {
                metrics.executions_started.inc();
            }
            DurableEvent::ExecutionSettled(e) => {
                let outcome = serde_json::to_value(e.outcome)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                metrics
                    .executions_settled
                    .get_or_create(&vec![("outcome", outcome)])
                    .inc();
            }
            DurableEvent::StepEnded(_) => step("ended"),
            DurableEvent::StepFailed(_) => step("failed"),
            DurableEvent::StepInterrupted(_) => step("interrupted"),
            DurableEvent::StepAwaiting(_) => step("awaiting"),
            DurableEvent::StepRecovered(_) => step("recovered"),
            _ => {}
        }
    }
}

/// A step ran for `elapsed`.
pub fn step_ran(elapsed: Duration) {
    m().step_seconds.observe(elapsed.as_secs_f64());
}

/// A model request ended: `outcome` is `ok` or the error's type.
pub fn provider_request(provider: &str, model: &str, outcome: &str) {
    m().provider_requests
        .get_or_create(&vec![
            ("provider", provider.to_owned()),
            ("model", model.to_owned()),
            ("outcome", outcome.to_owned()),
        ])
        .inc();
}

/// A model request's first event came `elapsed` after it was sent.
pub fn first_token(provider: &str, elapsed: Duration) {
    m().provider_first_token_seconds
        .get_or_create(&vec![("provider", provider.to_owned())])
        .observe(elapsed.as_secs_f64());
}

/// A provider reported `usage` for a request.
pub fn tokens(provider: &str, model: &str, usage: &keel_schema::types::Usage) {
    for (kind, count) in [
        ("input", usage.input),
        ("output", usage.output),
        ("cache_read", usage.cache_read),
        ("cache_write", usage.cache_write),
    ] {
        m().provider_tokens
            .get_or_create(&vec![
                ("provider", provider.to_owned()),
                ("model", model.to_owned()),
                ("kind", kind.to_owned()),
            ])
            .inc_by(count);
    }
}

/// A tool call ran for `elapsed`: `outcome` is `ok` or the error's type.
pub fn tool_ran(tool: &str, outcome: &str, elapsed: Duration) {
    let metrics = m();
    metrics
        .tool_calls
        .get_or_create(&vec![
            ("tool", tool.to_owned()),
            ("outcome", outcome.to_owned()),
        ])
        .inc();
    metrics
        .tool_seconds
        .get_or_create(&vec![("tool", tool.to_owned())])
        .observe(elapsed.as_secs_f64());
}

/// The writer committed a batch of `writes` that took `elapsed`.
pub fn store_committed(writes: usize, elapsed: Duration) {
    let metrics = m();
    metrics.store_commits.inc();
    metrics.store_commit_seconds.observe(elapsed.as_secs_f64());
    metrics.store_batch_writes.observe(writes as f64);
}

/// The writers a store may have whose queues [`store_queue`] adds up (the most
/// `--db-writers` allows).
pub const WRITERS: usize = 64;

/// What each writer last saw waiting, by its index.
static QUEUES: [std::sync::atomic::AtomicUsize; WRITERS] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; WRITERS];

/// `waiting` writes wait for writer `writer`; the gauge says how many wait for all of
/// them.
pub fn store_queue(writer: usize, waiting: usize) {
    use std::sync::atomic::Ordering;
    if let Some(queue) = QUEUES.get(writer) {
        queue.store(waiting, Ordering::Relaxed);
    }
    let total: usize = QUEUES.iter().map(|q| q.load(Ordering::Relaxed)).sum();
    m().store_queue
        .set(i64::try_from(total).unwrap_or(i64::MAX));
}

/// A recovery pass ran, recovering and quarantining so many claims.
pub fn recovery_pass(recovered: usize, quarantined: usize) {
    let metrics = m();
    metrics.recovery_passes.inc();
    for (result, count) in [("recovered", recovered), ("quarantined", quarantined)] {
        metrics
            .recovery_claims
            .get_or_create(&vec![("result", result.to_owned())])
            .inc_by(count as u64);
    }
}

/// An event stream opened; the stream is counted until the guard is dropped.
pub fn stream_opened() -> StreamGuard {
    m().stream_subscribers.inc();
    StreamGuard
}

/// Counts an open event stream until dropped.
pub struct StreamGuard;

impl Drop for StreamGuard {
    fn drop(&mut self) {
        m().stream_subscribers.dec();
    }
}

/// A write batch runs again for a remembered counter that had moved, or might have
/// ([`crate::event::counters`]).
pub fn store_stale_rerun() {
    m().store_stale_reruns.inc();
}

/// A subscriber fell behind and was disconnected.
pub fn stream_lagged() {
    m().stream_lagged.inc();
}

/// What the database says when the page is rendered.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shared {
    pub idle: u64,
    pub busy: u64,
    /// Sessions with a permission request or question waiting for a reply.
    pub waiting: u64,
    pub nodes: u64,
}

/// The metrics page, in the Prometheus text format.
pub fn render(shared: Shared) -> String {
    let metrics = m();
    for (state, count) in [
        ("idle", shared.idle),
        ("busy", shared.busy),
        ("waiting", shared.waiting),
    ] {
        metrics
            .sessions
            .get_or_create(&vec![("state", state.to_owned())])
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }
    metrics
        .nodes
        .set(i64::try_from(shared.nodes).unwrap_or(i64::MAX));
    let mut page = String::new();
    // Writing to a String cannot fail.
    encode(&mut page, &metrics.registry).expect("writing to a String cannot fail");
    page
}

/// `stream`, a model request's events, observed: the time to its first event, its outcome
/// when it finishes or fails, and the tokens it reports; it is polled inside a
/// `provider_request` span, so what the adapter logs carries the provider and model.
pub fn observed(
    request: &crate::provider::Request,
    stream: crate::provider::EventStream,
) -> crate::provider::EventStream {
    use futures::StreamExt as _;
    let (provider, model) = (request.model.provider.clone(), request.model.id.clone());
    let sent = std::time::Instant::now();
    let mut first = true;
    let span = tracing::info_span!("provider_request", provider = %provider, model = %model);
    let observed = stream.inspect(move |item| {
        if std::mem::take(&mut first) {
            first_token(&provider, sent.elapsed());
        }
        match item {
            Ok(crate::provider::Event::Finish { usage, .. }) => {
                provider_request(&provider, &model, "ok");
                tokens(&provider, &model, usage);
            }
            Err(error) => provider_request(&provider, &model, &error.info().kind),
            Ok(_) => {}
        }
    });
    Box::pin(InSpan {
        inner: Box::pin(observed),
        span,
    })
}

/// A stream polled inside `span`.
struct InSpan<S> {
    inner: std::pin::Pin<Box<S>>,
    span: tracing::Span,
}

impl<S: futures::Stream> futures::Stream for InSpan<S> {
    type Item = S::Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        let this = &mut *self;
        let _entered = this.span.enter();
        this.inner.as_mut().poll_next(cx)
    }
}
