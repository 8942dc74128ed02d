//! Each behaviour of SPEC section 7 as its own test. Drains, cleanups and settlements are
//! controlled from the test through channels: nothing sleeps and nothing is timed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use futures::FutureExt;
use tokio::sync::{mpsc, oneshot};

use super::*;

type Done = oneshot::Sender<Result<(), String>>;

/// The failure after which [`Probe`]'s busy period cannot go on (a lost claim).
const LOST: &str = "the claim was lost";

/// A call the coordinator made, held open until the test answers it.
#[derive(Debug)]
enum Call {
    Started {
        done: Done,
    },
    Drain {
        key: &'static str,
        request: Request,
        cancel: CancellationToken,
        done: Done,
    },
    Cleanup {
        done: Done,
    },
    Settled {
        key: &'static str,
        outcome: Result<(), String>,
        done: oneshot::Sender<()>,
    },
}

/// Work whose every hook reports to the test and waits for its answer.
struct Probe {
    calls: mpsc::UnboundedSender<Call>,
}

async fn answer(rx: oneshot::Receiver<Result<(), String>>) -> Result<(), String> {
    rx.await.unwrap_or(Err("the test dropped the call".into()))
}

impl Work for Probe {
    type Key = &'static str;
    type Error = String;

    fn started<'a>(&'a self, _: &'a &'static str) -> BoxFuture<'a, Result<(), String>> {
        let (done, rx) = oneshot::channel();
        self.calls.send(Call::Started { done }).unwrap();
        Box::pin(answer(rx))
    }

    fn drain<'a>(
        &'a self,
        key: &'a &'static str,
        request: Request,
        cancel: CancellationToken,
    ) -> BoxFuture<'a, Result<(), String>> {
        let (done, rx) = oneshot::channel();
        self.calls
            .send(Call::Drain {
                key,
                request,
                cancel,
                done,
            })
            .unwrap();
        Box::pin(answer(rx))
    }

    fn ends_busy_period(&self, error: &String) -> bool {
        error == LOST
    }

    fn cleanup<'a>(&'a self, _: &'a &'static str) -> BoxFuture<'a, Result<(), String>> {
        let (done, rx) = oneshot::channel();
        self.calls.send(Call::Cleanup { done }).unwrap();
        Box::pin(answer(rx))
    }

    fn settled<'a>(
        &'a self,
        key: &'a &'static str,
        outcome: &'a Result<(), String>,
    ) -> BoxFuture<'a, ()> {
        let (done, rx) = oneshot::channel();
        self.calls
            .send(Call::Settled {
                key,
                outcome: outcome.clone(),
                done,
            })
            .unwrap();
        Box::pin(async move {
            drop(rx.await);
        })
    }
}

struct Harness {
    coordinator: Coordinator<Probe>,
    calls: mpsc::UnboundedReceiver<Call>,
}

impl Harness {
    fn new() -> Self {
        let (tx, calls) = mpsc::unbounded_channel();
        Self {
            coordinator: Coordinator::new(Probe { calls: tx }),
            calls,
        }
    }

    async fn next(&mut self) -> Call {
        self.calls
            .recv()
            .await
            .expect("the coordinator makes another call")
    }

    /// Answers `started` and returns the drain that follows.
    async fn start(&mut self) -> (Request, CancellationToken, Done) {
        match self.next().await {
            Call::Started { done, .. } => done.send(Ok(())).unwrap(),
            other => panic!("expected started, got {other:?}"),
        }
        self.drain().await
    }

    async fn drain(&mut self) -> (Request, CancellationToken, Done) {
        match self.next().await {
            Call::Drain {
                request,
                cancel,
                done,
                ..
            } => (request, cancel, done),
            other => panic!("expected a drain, got {other:?}"),
        }
    }

    async fn cleanup(&mut self) -> Done {
        match self.next().await {
            Call::Cleanup { done, .. } => done,
            other => panic!("expected cleanup, got {other:?}"),
        }
    }

    /// Answers `settled`, returning the outcome it was given.
    async fn settle(&mut self) -> Result<(), String> {
        match self.next().await {
            Call::Settled { outcome, done, .. } => {
                done.send(()).unwrap();
                outcome
            }
            other => panic!("expected settled, got {other:?}"),
        }
    }

    /// Lets spawned tasks run until none can make progress.
    async fn quiesce(&self) {
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
    }

    fn assert_no_call(&mut self) {
        if let Ok(call) = self.calls.try_recv() {
            panic!("unexpected call {call:?}");
        }
    }
}

const FORCED: Request = Request {
    force: true,
    scope: None,
};

fn woken(scope: Scope) -> Request {
    Request {
        force: false,
        scope: Some(scope),
    }
}

#[tokio::test]
async fn run_when_idle_starts_a_forced_drain() {
    let mut h = Harness::new();
    let run = tokio::spawn(h.coordinator.run("a"));
    let (request, _, done) = h.start().await;
    assert_eq!(request, FORCED);
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    assert_eq!(run.await.unwrap(), Ok(()));
    h.quiesce().await;
    assert!(!h.coordinator.is_busy(&"a"));
    h.assert_no_call();
}

#[tokio::test]
async fn run_while_a_drain_runs_joins_it() {
    let mut h = Harness::new();
    let first = tokio::spawn(h.coordinator.run("a"));
    let (_, _, done) = h.start().await;
    let second = tokio::spawn(h.coordinator.run("a"));
    h.quiesce().await;
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    assert_eq!(first.await.unwrap(), Ok(()));
    assert_eq!(second.await.unwrap(), Ok(()));
    h.quiesce().await;
    h.assert_no_call();
}

#[tokio::test]
async fn run_while_stopping_waits_for_cleanup_then_starts_fresh() {
    let mut h = Harness::new();
    let first = tokio::spawn(h.coordinator.run("a"));
    let (_, cancel, done) = h.start().await;
    assert!(h.coordinator.interrupt(&"a"));
    assert!(cancel.is_cancelled());
    let second = tokio::spawn(h.coordinator.run("a"));
    h.quiesce().await;
    done.send(Err("interrupted".into())).unwrap();
    h.cleanup().await.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Err("interrupted".into()));
    assert_eq!(
        first.await.unwrap(),
        Err(RunError::Failed("interrupted".into()))
    );
    let (request, _, done) = h.start().await;
    assert_eq!(request, FORCED);
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    assert_eq!(second.await.unwrap(), Ok(()));
}

#[tokio::test]
async fn wake_when_idle_starts_an_unforced_drain() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Steer);
    let (request, _, done) = h.start().await;
    assert_eq!(request, woken(Scope::Steer));
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    h.quiesce().await;
    assert!(!h.coordinator.is_busy(&"a"));
}

#[tokio::test]
async fn wakes_while_active_coalesce_into_exactly_one_follow_up_where_input_wins_over_steer() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Steer);
    let (_, _, done) = h.start().await;
    h.coordinator.wake("a", Scope::Steer);
    h.coordinator.wake("a", Scope::Input);
    h.coordinator.wake("a", Scope::Steer);
    done.send(Ok(())).unwrap();
    let (request, _, done) = h.drain().await;
    assert_eq!(request, woken(Scope::Input));
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    h.quiesce().await;
    h.assert_no_call();
}

#[tokio::test]
async fn a_follow_up_takes_the_doorbells_scope_not_the_last_drains() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Input);
    let (request, _, done) = h.start().await;
    assert_eq!(request, woken(Scope::Input));
    h.coordinator.wake("a", Scope::Steer);
    done.send(Ok(())).unwrap();
    let (request, _, done) = h.drain().await;
    assert_eq!(request, woken(Scope::Steer));
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
}

#[tokio::test]
async fn joining_a_wake_started_execution_never_forces_a_successor() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Input);
    let (request, _, done) = h.start().await;
    let joined = tokio::spawn(h.coordinator.run("a"));
    h.quiesce().await;
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    assert_eq!(joined.await.unwrap(), Ok(()));
    h.quiesce().await;
    h.assert_no_call();
    // The only drain was the wake's: forces == [false].
    assert!(!request.force);
}

#[tokio::test]
async fn interrupt_when_idle_is_a_no_op_returning_false() {
    let mut h = Harness::new();
    assert!(!h.coordinator.interrupt(&"a"));
    h.quiesce().await;
    h.assert_no_call();
}

#[tokio::test]
async fn interrupt_while_already_stopping_is_a_no_op_returning_false() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Input);
    let (_, _, done) = h.start().await;
    assert!(h.coordinator.interrupt(&"a"));
    assert!(!h.coordinator.interrupt(&"a"));
    done.send(Err("interrupted".into())).unwrap();
    h.cleanup().await.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Err("interrupted".into()));
}

#[tokio::test]
async fn interrupt_clears_the_doorbell_cancels_the_drain_and_returns_before_cleanup_finishes() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Input);
    let (_, cancel, done) = h.start().await;
    h.coordinator.wake("a", Scope::Input);
    assert!(h.coordinator.interrupt(&"a"));
    assert!(cancel.is_cancelled());
    done.send(Err("interrupted".into())).unwrap();
    let cleanup = h.cleanup().await;
    // Cleanup is still running and the key is still busy.
    assert!(h.coordinator.is_busy(&"a"));
    cleanup.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Err("interrupted".into()));
    h.quiesce().await;
    // The cleared doorbell started no successor.
    h.assert_no_call();
    assert!(!h.coordinator.is_busy(&"a"));
}

#[tokio::test]
async fn once_interrupted_cleanup_runs_to_its_end_in_the_busy_period_whatever_the_callers_do() {
    let mut h = Harness::new();
    let caller = tokio::spawn(h.coordinator.run("a"));
    let (_, cancel, done) = h.start().await;
    // The interrupter does not wait: interrupt returns at once, before cleanup.
    assert!(h.coordinator.interrupt(&"a"));
    assert!(cancel.is_cancelled());
    done.send(Err("interrupted".into())).unwrap();
    let cleanup = h.cleanup().await;
    // Everyone goes away or tries again: the caller that started the execution, a
    // second interrupt, a caller that joins and is dropped.
    caller.abort();
    assert!(caller.await.unwrap_err().is_cancelled());
    assert!(!h.coordinator.interrupt(&"a"));
    drop(h.coordinator.run("a"));
    h.quiesce().await;
    // Cleanup was not cut short: its future is still alive, and the key stays busy
    // until it ends.
    assert!(!cleanup.is_closed(), "the coordinator dropped the cleanup");
    assert!(h.coordinator.is_busy(&"a"));
    h.assert_no_call();
    cleanup.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Err("interrupted".into()));
    // The dropped joiner's resume still runs once, after cleanup and settlement.
    let (request, _, done) = h.start().await;
    assert_eq!(request, FORCED);
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    h.quiesce().await;
    h.assert_no_call();
    assert!(!h.coordinator.is_busy(&"a"));
}

#[tokio::test]
async fn a_wake_during_cleanup_starts_one_successor_only_after_cleanup() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Input);
    let (_, _, done) = h.start().await;
    assert!(h.coordinator.interrupt(&"a"));
    done.send(Err("interrupted".into())).unwrap();
    let cleanup = h.cleanup().await;
    h.coordinator.wake("a", Scope::Steer);
    h.coordinator.wake("a", Scope::Steer);
    h.quiesce().await;
    h.assert_no_call();
    cleanup.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Err("interrupted".into()));
    let (request, _, done) = h.start().await;
    assert_eq!(request, woken(Scope::Steer));
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    h.quiesce().await;
    h.assert_no_call();
}

#[tokio::test]
async fn a_resume_registered_during_cleanup_yields_forces_false_then_true() {
    let mut h = Harness::new();
    let mut forces = Vec::new();
    h.coordinator.wake("a", Scope::Input);
    let (request, _, done) = h.start().await;
    forces.push(request.force);
    assert!(h.coordinator.interrupt(&"a"));
    done.send(Err("interrupted".into())).unwrap();
    let cleanup = h.cleanup().await;
    let resumed = tokio::spawn(h.coordinator.run("a"));
    h.quiesce().await;
    cleanup.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Err("interrupted".into()));
    let (request, _, done) = h.start().await;
    forces.push(request.force);
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    assert_eq!(resumed.await.unwrap(), Ok(()));
    h.quiesce().await;
    h.assert_no_call();
    assert_eq!(forces, vec![false, true]);
}

#[tokio::test]
async fn a_wake_racing_a_failure_gives_the_joined_caller_that_failure_and_runs_one_successor() {
    let mut h = Harness::new();
    let mut runs = 0;
    let caller = tokio::spawn(h.coordinator.run("a"));
    let (_, _, done) = h.start().await;
    runs += 1;
    h.coordinator.wake("a", Scope::Input);
    done.send(Err("provider exploded".into())).unwrap();
    let (request, _, done) = h.drain().await;
    runs += 1;
    assert_eq!(request, woken(Scope::Input));
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    assert_eq!(
        caller.await.unwrap(),
        Err(RunError::Failed("provider exploded".into()))
    );
    h.quiesce().await;
    h.assert_no_call();
    assert_eq!(runs, 2);
}

#[tokio::test]
async fn a_wake_racing_a_failure_that_ends_the_busy_period_starts_a_new_one() {
    let mut h = Harness::new();
    let caller = tokio::spawn(h.coordinator.run("a"));
    let (_, _, done) = h.start().await;
    h.coordinator.wake("a", Scope::Input);
    done.send(Err(LOST.into())).unwrap();
    // The lost busy period settles with its failure, without a follow-up drain …
    assert_eq!(h.settle().await, Err(LOST.into()));
    // … and the wake starts a new busy period, which claims afresh.
    let (request, _, done) = h.start().await;
    assert_eq!(request, woken(Scope::Input));
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
    assert_eq!(caller.await.unwrap(), Err(RunError::Failed(LOST.into())));
    h.quiesce().await;
    h.assert_no_call();
}

#[tokio::test]
async fn dropping_a_joined_waiter_never_cancels_the_execution() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Input);
    let (_, cancel, done) = h.start().await;
    let waiter = tokio::spawn(h.coordinator.run("a"));
    h.quiesce().await;
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    assert!(!cancel.is_cancelled());
    done.send(Ok(())).unwrap();
    assert_eq!(h.settle().await, Ok(()));
}

#[tokio::test]
async fn different_keys_run_concurrently() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Input);
    h.coordinator.wake("b", Scope::Input);
    let mut open = Vec::new();
    while open.len() < 2 {
        match h.next().await {
            Call::Started { done, .. } => done.send(Ok(())).unwrap(),
            Call::Drain { key, done, .. } => open.push((key, done)),
            other => panic!("unexpected {other:?}"),
        }
    }
    // Both drains are open at once.
    let mut keys: Vec<&str> = open.iter().map(|(k, _)| *k).collect();
    keys.sort();
    assert_eq!(keys, vec!["a", "b"]);
    for (_, done) in open {
        done.send(Ok(())).unwrap();
    }
    let mut settled = Vec::new();
    while settled.len() < 2 {
        match h.next().await {
            Call::Settled { key, done, .. } => {
                done.send(()).unwrap();
                settled.push(key);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    settled.sort();
    assert_eq!(settled, vec!["a", "b"]);
}

#[tokio::test]
async fn started_and_settled_run_once_per_busy_period_and_waiters_resolve_only_after_settled() {
    let mut h = Harness::new();
    let mut caller = Box::pin(h.coordinator.run("a"));
    let (_, _, done) = h.start().await;
    h.coordinator.wake("a", Scope::Input);
    done.send(Ok(())).unwrap();
    let (_, _, done) = h.drain().await;
    done.send(Ok(())).unwrap();
    // The driver is now inside `settled` and waits for the test.
    let Call::Settled { done, .. } = h.next().await else {
        panic!("expected settled")
    };
    h.quiesce().await;
    assert!(
        (&mut caller).now_or_never().is_none(),
        "resolved before settled"
    );
    done.send(()).unwrap();
    assert_eq!(caller.await, Ok(()));
    h.quiesce().await;
    // Two drains, one `started`, one `settled`.
    h.assert_no_call();
}

#[tokio::test]
async fn a_failed_start_fails_its_waiters_and_runs_no_drain() {
    let mut h = Harness::new();
    let caller = tokio::spawn(h.coordinator.run("a"));
    match h.next().await {
        Call::Started { done, .. } => done.send(Err("claimed elsewhere".into())).unwrap(),
        other => panic!("expected started, got {other:?}"),
    }
    assert_eq!(h.settle().await, Err("claimed elsewhere".into()));
    assert_eq!(
        caller.await.unwrap(),
        Err(RunError::Failed("claimed elsewhere".into()))
    );
    h.quiesce().await;
    h.assert_no_call();
    assert!(!h.coordinator.is_busy(&"a"));
}

#[tokio::test]
async fn a_failed_cleanup_surfaces_its_cause_as_the_outcome() {
    let mut h = Harness::new();
    h.coordinator.wake("a", Scope::Input);
    let (_, _, done) = h.start().await;
    assert!(h.coordinator.interrupt(&"a"));
    done.send(Err("interrupted".into())).unwrap();
    h.cleanup()
        .await
        .send(Err("database unreachable".into()))
        .unwrap();
    assert_eq!(h.settle().await, Err("database unreachable".into()));
}

/// Work whose drain wakes its own key synchronously until a budget runs out.
struct SelfWaking {
    coordinator: OnceLock<Coordinator<SelfWaking>>,
    remaining: AtomicUsize,
    runs: AtomicUsize,
    settled: Mutex<Option<oneshot::Sender<()>>>,
}

impl Work for SelfWaking {
    type Key = u8;
    type Error = String;

    fn started<'a>(&'a self, _: &'a u8) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn drain<'a>(
        &'a self,
        key: &'a u8,
        _: Request,
        _: CancellationToken,
    ) -> BoxFuture<'a, Result<(), String>> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        if self
            .remaining
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.coordinator.get().unwrap().wake(*key, Scope::Input);
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn cleanup<'a>(&'a self, _: &'a u8) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn settled<'a>(&'a self, _: &'a u8, _: &'a Result<(), String>) -> BoxFuture<'a, ()> {
        if let Some(done) = self.settled.lock().unwrap().take() {
            done.send(()).unwrap();
        }
        Box::pin(std::future::ready(()))
    }
}

#[tokio::test]
async fn twenty_thousand_synchronous_self_wakes_trampoline_without_stack_growth() {
    let (done, settled) = oneshot::channel();
    let coordinator = Coordinator::new(SelfWaking {
        coordinator: OnceLock::new(),
        remaining: AtomicUsize::new(19_999),
        runs: AtomicUsize::new(0),
        settled: Mutex::new(Some(done)),
    });
    let work = coordinator.work().clone();
    work.coordinator.set(coordinator.clone()).ok().unwrap();
    // Run on a thread with a small stack: recursion per wake would overflow it.
    let outcome = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
                .block_on(async move {
                    coordinator.wake(7, Scope::Input);
                    settled.await
                })
        })
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(outcome, Ok(()));
    assert_eq!(work.runs.load(Ordering::SeqCst), 20_000);
}
