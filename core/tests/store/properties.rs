//! Property tests: for any interleaving of admissions, retries, promotions and
//! cancellations the inbox keeps its ordering and idempotency rules; and seq stays gapless
//! per session under concurrent appends from several tasks.

use std::collections::HashMap;

use keel_core::inbox::{self, Admission, Boundary, Promotion};
use keel_core::store::Store;
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::InputId;
use keel_schema::types::{CompactionReason, Delivery, InputKind, InputSource, Part};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::support::{TestDb, new_session, new_sessions};

#[derive(Debug, Clone)]
enum Op {
    /// Admit into session `session` (0 or 1), with client id `slot` (or a fresh id), the
    /// content `content` (so the same slot may come back with the same or other content).
    Admit {
        session: usize,
        slot: Option<usize>,
        control: bool,
        steer: bool,
        content: u8,
    },
    Promote {
        session: usize,
        idle: bool,
    },
    Cancel {
        slot: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..2usize, proptest::option::of(0..4usize), prop::bool::weighted(0.15), any::<bool>(), 0..2u8)
            .prop_map(|(session, slot, control, steer, content)| Op::Admit {
                session, slot, control, steer, content
            }),
        2 => (0..2usize, any::<bool>()).prop_map(|(session, idle)| Op::Promote { session, idle }),
        1 => (0..4usize).prop_map(|slot| Op::Cancel { slot }),
    ]
}

/// An independent statement of the promotion rules, kept apart from the implementation.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ModelInput {
    id: InputId,
    control: bool,
    steer: bool,
}

fn expected_promotion(pending: &[ModelInput], idle: bool) -> Vec<ModelInput> {
    let mut steers = Vec::new();
    for input in pending {
        if input.control {
            break;
        }
        if input.steer {
            steers.push(*input);
        }
    }
    if !steers.is_empty() || !idle {
        return steers;
    }
    pending
        .first()
        .map(|first| vec![*first])
        .unwrap_or_default()
}

fn admission(slot_id: Option<InputId>, control: bool, steer: bool, content: u8) -> Admission {
    Admission {
        id: slot_id,
        kind: if control {
            InputKind::Compact
        } else {
            InputKind::Prompt
        },
        parts: if control {
            vec![]
        } else {
            vec![Part::Text {
                text: format!("content {content}"),
            }]
        },
        delivery: if steer {
            Delivery::Steer
        } else {
            Delivery::Queue
        },
        source: InputSource::User,
        request_execution: true,
    }
}

async fn check_inbox(store: &Store, ops: Vec<Op>) {
    let sessions = [new_session(store).await, new_session(store).await];
    let slot_ids: Vec<InputId> = (0..4).map(|_| InputId::new()).collect();
    // slot -> (session index, the admission first made with it)
    let mut slots: HashMap<usize, (usize, Admission)> = HashMap::new();
    let mut pending: [Vec<ModelInput>; 2] = [Vec::new(), Vec::new()];
    let clock = store.clock().clone();

    for op in ops {
        match op {
            Op::Admit {
                session,
                slot,
                control,
                steer,
                content,
            } => {
                let request = admission(slot.map(|s| slot_ids[s]), control, steer, content);
                let seqs_before = (
                    store.last_seq(sessions[0]).await.unwrap(),
                    store.last_seq(sessions[1]).await.unwrap(),
                );
                let (id, now) = (sessions[session], clock.now_ms());
                let r = request.clone();
                let result = store
                    .write(move |c| inbox::admit(c, now, id, r.clone()))
                    .await;
                match slot.and_then(|s| slots.get(&s).cloned()) {
                    Some((first_session, first)) => {
                        let seqs_after = (
                            store.last_seq(sessions[0]).await.unwrap(),
                            store.last_seq(sessions[1]).await.unwrap(),
                        );
                        assert_eq!(seqs_after, seqs_before, "a retry writes nothing");
                        if first_session == session && first == request {
                            let admitted = result.expect("an identical retry is replayed");
                            assert!(admitted.replayed);
                            assert_eq!(admitted.input.id, request.id.unwrap());
                        } else {
                            assert!(
                                matches!(result, Err(inbox::Error::Conflict { .. })),
                                "{result:?}"
                            );
                        }
                    }
                    None => {
                        let admitted = result.expect("a new admission succeeds");
                        assert!(!admitted.replayed && admitted.wake);
                        if let Some(s) = slot {
                            slots.insert(s, (session, request));
                        }
                        pending[session].push(ModelInput {
                            id: admitted.input.id,
                            control,
                            steer,
                        });
                    }
                }
            }
            Op::Promote { session, idle } => {
                let expected = expected_promotion(&pending[session], idle);
                let boundary = if idle { Boundary::Idle } else { Boundary::Step };
                let (id, now) = (sessions[session], clock.now_ms());
                let promotion = store
                    .write(move |c| inbox::promote(c, now, id, boundary))
                    .await
                    .unwrap();
                let got: Vec<InputId> = match &promotion {
                    Promotion::Nothing => vec![],
                    Promotion::Prompts(p) => p.iter().map(|(i, _)| *i).collect(),
                    Promotion::Control(input) => {
                        // Carry the control input out, as the runner would.
                        store
                            .append(
                                id,
                                vec![DurableEvent::CompactionStarted(
                                    payload::CompactionStarted {
                                        reason: CompactionReason::Manual,
                                        input_id: Some(input.id),
                                    },
                                )],
                            )
                            .await
                            .unwrap();
                        vec![input.id]
                    }
                };
                let want: Vec<InputId> = expected.iter().map(|i| i.id).collect();
                assert_eq!(got, want, "promotion at {boundary:?}");
                pending[session].retain(|i| !want.contains(&i.id));
            }
            Op::Cancel { slot } => {
                let Some((session, _)) = slots.get(&slot).cloned() else {
                    continue;
                };
                let input_id = slot_ids[slot];
                let (id, now) = (sessions[session], clock.now_ms());
                let result = store
                    .write(move |c| inbox::cancel(c, now, id, input_id))
                    .await;
                let was_pending = pending[session].iter().any(|i| i.id == input_id);
                assert_eq!(result.is_ok(), was_pending, "{result:?}");
                pending[session].retain(|i| i.id != input_id);
            }
        }
    }

    // Whatever happened: each session's log is gapless, and no input was promoted twice.
    for session in sessions {
        let log = store.read_log(session, 0, 10_000).await.unwrap();
        let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=log.len() as u64).collect::<Vec<_>>());
        let mut promoted: Vec<InputId> = log
            .iter()
            .filter_map(|e| match &e.event {
                DurableEvent::Prompted(p) => Some(p.input_id),
                DurableEvent::CompactionStarted(c) => c.input_id,
                _ => None,
            })
            .collect();
        let total = promoted.len();
        promoted.sort();
        promoted.dedup();
        assert_eq!(promoted.len(), total, "an input was promoted twice");
    }
}

/// (session, events in this append) for each append of one task.
type Plan = Vec<Vec<(usize, usize)>>;

fn plan() -> impl Strategy<Value = Plan> {
    prop::collection::vec(prop::collection::vec((0..4usize, 1..4usize), 1..12), 2..8)
}

async fn check_concurrent_appends(store: &Store, plan: Plan) {
    let sessions = new_sessions(store, 4).await;
    let mut tasks = Vec::new();
    for (task, appends) in plan.iter().cloned().enumerate() {
        let store = store.clone();
        let sessions = sessions.clone();
        tasks.push(tokio::spawn(async move {
            for (n, (session, count)) in appends.into_iter().enumerate() {
                let events = (0..count)
                    .map(|k| {
                        DurableEvent::Renamed(payload::Renamed {
                            title: format!("{task}:{n}:{k}"),
                        })
                    })
                    .collect();
                store.append(sessions[session], events).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let mut seen: HashMap<usize, Vec<(usize, usize)>> = HashMap::new();
    for &session in &sessions {
        let log = store.read_log(session, 0, 10_000).await.unwrap();
        let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=log.len() as u64).collect::<Vec<_>>(), "gapless");
        for event in &log[1..] {
            let DurableEvent::Renamed(r) = &event.event else {
                panic!("unexpected {event:?}")
            };
            let parts: Vec<usize> = r.title.split(':').map(|p| p.parse().unwrap()).collect();
            seen.entry(parts[0]).or_default().push((parts[1], parts[2]));
        }
    }
    // Every event of every task is there once, and each task's events of one session keep
    // their order (checked by counting: per task the (append, index) pairs are complete).
    for (task, appends) in plan.iter().enumerate() {
        let mut got = seen.remove(&task).unwrap_or_default();
        got.sort();
        let want: Vec<(usize, usize)> = appends
            .iter()
            .enumerate()
            .flat_map(|(n, &(_, count))| (0..count).map(move |k| (n, k)))
            .collect();
        assert_eq!(got, want, "task {task}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn inbox_property(db: TestDb, cases: u32) {
    let rt = runtime();
    let store = rt.block_on(db.open());
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&prop::collection::vec(op(), 1..30), |ops| {
            rt.block_on(check_inbox(&store, ops));
            Ok(())
        })
        .unwrap();
}

fn append_property(db: TestDb, cases: u32) {
    let rt = runtime();
    let store = rt.block_on(db.open());
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&plan(), |plan| {
            rt.block_on(check_concurrent_appends(&store, plan));
            Ok(())
        })
        .unwrap();
}

mod sqlite {
    use crate::support::TestDb;

    #[test]
    fn the_inbox_keeps_its_order_and_idempotency_rules_for_any_interleaving() {
        super::inbox_property(TestDb::sqlite(), 64);
    }

    #[test]
    fn seq_stays_gapless_per_session_under_concurrent_appends() {
        super::append_property(TestDb::sqlite(), 32);
    }
}

mod postgres {
    use crate::support::TestDb;

    #[test]
    fn the_inbox_keeps_its_order_and_idempotency_rules_for_any_interleaving() {
        if let Some(db) = TestDb::postgres() {
            super::inbox_property(db, 32);
        }
    }

    #[test]
    fn seq_stays_gapless_per_session_under_concurrent_appends() {
        if let Some(db) = TestDb::postgres() {
            super::append_property(db, 16);
        }
    }
}
