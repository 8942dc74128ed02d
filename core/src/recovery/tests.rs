//! The compare-and-sets between a pass's selection and what it does: a claim that changed
//! after a pass selected it is neither recovered nor quarantined, and a lost wake whose
//! work was settled since is not woken; and the scan's plan on both backends. (Whole
//! passes are tested in `core/tests/runner/recovery.rs`.)

use std::sync::Arc;

use keel_schema::types::ModelRef;

use super::*;
use crate::store::{DbUrl, Options};

const NOW: i64 = 1_764_690_000_000;

struct Fixture {
    store: Store,
    session: SessionId,
    _dir: tempfile::TempDir,
}

/// A session with an expired claim of a dead owner, and a pass's selection of it.
async fn selected() -> (Fixture, Candidate) {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(crate::clock::ManualClock::new(NOW));
    let options = Options {
        clock,
        ..Options::default()
    };
    let store = Store::open(DbUrl::Sqlite(dir.path().join("keel.db")), options)
        .await
        .unwrap();
    let session = SessionId::new();
    store
        .write(move |c| {
            create(c, session)?;
            claim(c, session, ExecutionId::new(), NOW - 1)
        })
        .await
        .unwrap();
    let mut candidates = store.read(|c| expired(c, NOW)).await.unwrap();
    assert_eq!(candidates.len(), 1);
    let fixture = Fixture {
        store,
        session,
        _dir: dir,
    };
    (fixture, candidates.remove(0))
}

fn create(c: &mut Conn, session: SessionId) -> Result<(), store::Error> {
    log::append(
        c,
        NOW,
        session,
        vec![DurableEvent::Created(payload::Created {
            title: None,
            directory: "/".into(),
            agent: "build".into(),
            model: ModelRef {
                provider: "p".into(),
                id: "m".into(),
            },
            metadata: None,
        })],
    )?;
    Ok(())
}

fn claim(
    c: &mut Conn,
    session: SessionId,
    id: ExecutionId,
    expires_at: i64,
) -> Result<(), store::Error> {
    diesel::insert_into(session_execution::table)
        .values((
            session_execution::id.eq(id.to_string()),
            session_execution::session_id.eq(session.to_string()),
            session_execution::owner_id.eq(keel_schema::id::OwnerId::new().to_string()),
            session_execution::phase.eq("claimed"),
            session_execution::time_created.eq(expires_at),
            session_execution::expires_at.eq(expires_at),
        ))
        .execute(c)?;
    Ok(())
}

/// Runs `change`, then recovers the stale selection; returns what recovery made of
/// it and the claims left, with their recovery errors.
async fn after(
    change: impl FnMut(&mut Conn) -> Result<(), store::Error> + Send + 'static,
) -> (bool, Vec<(String, Option<String>)>, u64) {
    let (fixture, candidate) = selected().await;
    fixture.store.write(change).await.unwrap();
    let moved = fixture
        .store
        .write(move |c| recover(c, NOW, &candidate))
        .await
        .map(|r| matches!(r, Recovered::Moved))
        .unwrap();
    let session = fixture.session;
    let (claims, last) = fixture
        .store
        .read(move |c| {
            let claims = session_execution::table
                .select((session_execution::id, session_execution::recovery_error))
                .load::<(String, Option<String>)>(c)?;
            Ok::<_, store::Error>((claims, log::last_seq(c, session)?.unwrap_or(0)))
        })
        .await
        .unwrap();
    (moved, claims, last)
}

#[tokio::test]
async fn a_claim_renewed_after_selection_is_left_alone() {
    let (moved, claims, last) = after(|c| {
        diesel::update(session_execution::table)
            .set(session_execution::expires_at.eq(NOW + 30_000))
            .execute(c)?;
        Ok(())
    })
    .await;
    assert!(moved);
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].1, None, "a live claim is never quarantined");
    assert_eq!(last, 1, "nothing was appended");
}

#[tokio::test]
async fn a_claim_settled_after_selection_is_not_recovered() {
    let (moved, claims, last) = after(|c| {
        diesel::delete(session_execution::table).execute(c)?;
        Ok(())
    })
    .await;
    assert!(moved);
    assert!(claims.is_empty());
    assert_eq!(last, 1);
}

#[tokio::test]
async fn a_claim_interrupted_after_selection_is_left_to_a_later_pass_never_continued() {
    let (moved, claims, last) = after(|c| {
        let session: String = session_execution::table
            .select(session_execution::session_id)
            .first(c)?;
        crate::execution::request_cancel(c, session.parse().unwrap())?;
        Ok(())
    })
    .await;
    assert!(moved, "the selection saw it running; it is cancelling now");
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].1, None);
    assert_eq!(last, 1, "no continuation was admitted");
}

#[tokio::test]
async fn a_claim_replaced_after_selection_is_left_to_a_later_pass() {
    let replacement = ExecutionId::new();
    let (moved, claims, last) = after(move |c| {
        let session: String = session_execution::table
            .select(session_execution::session_id)
            .first(c)?;
        diesel::delete(session_execution::table).execute(c)?;
        // Another owner took the session and died too: a new claim, also expired.
        claim(c, session.parse().unwrap(), replacement, NOW - 1)
    })
    .await;
    assert!(moved);
    assert_eq!(claims, vec![(replacement.to_string(), None)]);
    assert_eq!(last, 1);
}

#[tokio::test]
async fn redrive_reaches_lost_wakes_beyond_a_full_batch_and_wraps_around() {
    let (fixture, _) = selected().await;
    let count = usize::try_from(BATCH_SIZE).unwrap() + 1;
    let mut sessions: Vec<SessionId> = (0..count).map(|_| SessionId::new()).collect();
    let waiting = sessions.clone();
    fixture
        .store
        .write(move |c| {
            for &session in &waiting {
                create(c, session)?;
                let prompt = Admission::prompt(vec![Part::Text { text: "hi".into() }]);
                inbox::admit(c, NOW, session, prompt)
                    .map_err(|e| store::Error::Corrupt(e.to_string()))?;
            }
            Ok::<_, store::Error>(())
        })
        .await
        .unwrap();
    sessions.sort_by_key(ToString::to_string);
    let batch = usize::try_from(BATCH_SIZE).unwrap();

    let first = fixture.store.read(|c| lost_wakes(c, None)).await.unwrap();
    assert_eq!(first, sessions[..batch]);
    // The session behind the full batch comes first on the next pass, then the scan
    // wraps around to the start.
    let after = first.last().unwrap().to_string();
    let second = fixture
        .store
        .read(move |c| lost_wakes(c, Some(&after)))
        .await
        .unwrap();
    assert_eq!(second[0], sessions[batch]);
    assert_eq!(second[1..], sessions[..batch - 1]);
}

/// Admits a prompt with execution requested into a new session, as a process that died
/// before its wake leaves it; returns the session and the input.
fn lost_wake(c: &mut Conn) -> Result<(SessionId, InputId), store::Error> {
    let session = SessionId::new();
    create(c, session)?;
    let prompt = Admission::prompt(vec![Part::Text { text: "hi".into() }]);
    let admitted =
        inbox::admit(c, NOW, session, prompt).map_err(|e| store::Error::Corrupt(e.to_string()))?;
    Ok((session, admitted.input.id))
}

#[tokio::test]
async fn work_settled_between_selection_and_the_redrive_is_not_woken() {
    use std::sync::Mutex;

    use crate::execution;

    let (fixture, _) = selected().await;
    let sessions = fixture
        .store
        .write(|c| (0..5).map(|_| lost_wake(c)).collect::<Result<Vec<_>, _>>())
        .await
        .unwrap();
    let [cancelled, claimed, ran, busy, waiting] = sessions.try_into().unwrap();
    let lost = fixture.store.read(|c| lost_wakes(c, None)).await.unwrap();
    let mut all = vec![cancelled.0, claimed.0, ran.0, busy.0, waiting.0];
    all.sort_by_key(ToString::to_string);
    assert_eq!(lost, all, "every one of them was a lost wake when selected");

    // Between the selection and the redrive: one input is cancelled, another process
    // claims one session and runs another to the end, and this process starts on one.
    fixture
        .store
        .write(move |c| {
            let fail = |e: inbox::Error| store::Error::Corrupt(e.to_string());
            inbox::cancel(c, NOW, cancelled.0, cancelled.1).map_err(fail)?;
            let other = keel_schema::id::OwnerId::new();
            execution::acquire(c, NOW, 30_000, claimed.0, other)?;
            let (claim, _) = execution::acquire(c, NOW, 30_000, ran.0, other)?
                .expect("the session has no claim");
            inbox::promote(c, NOW, ran.0, inbox::Boundary::Idle).map_err(fail)?;
            execution::release(c, NOW, 30_000, &claim, Outcome::Succeeded, None)
                .map_err(|e| store::Error::Corrupt(e.to_string()))?;
            Ok::<_, store::Error>(())
        })
        .await
        .unwrap();

    let woken = Mutex::new(Vec::new());
    let redriven = redrive(
        &fixture.store,
        lost,
        |session| session == busy.0,
        |session| woken.lock().unwrap().push(session),
    )
    .await
    .unwrap();
    assert_eq!(redriven, vec![waiting.0]);
    assert_eq!(*woken.lock().unwrap(), vec![waiting.0]);
}

/// `EXPLAIN` (with its prefix) of a query, loaded as rows of `Row`.
struct Explain<Q, Row> {
    prefix: &'static str,
    query: Q,
    row: std::marker::PhantomData<Row>,
}

impl<Q, Row> Explain<Q, Row> {
    fn new(prefix: &'static str, query: Q) -> Self {
        Self {
            prefix,
            query,
            row: std::marker::PhantomData,
        }
    }
}

impl<Q, Row, DB> diesel::query_builder::QueryFragment<DB> for Explain<Q, Row>
where
    DB: diesel::backend::Backend,
    Q: diesel::query_builder::QueryFragment<DB>,
{
    fn walk_ast<'b>(
        &'b self,
        mut out: diesel::query_builder::AstPass<'_, 'b, DB>,
    ) -> QueryResult<()> {
        out.push_sql(self.prefix);
        self.query.walk_ast(out.reborrow())
    }
}

impl<Q, Row> diesel::query_builder::QueryId for Explain<Q, Row> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q, Row> diesel::query_builder::Query for Explain<Q, Row> {
    type SqlType = Row;
}

impl<Q, Row, C> RunQueryDsl<C> for Explain<Q, Row> {}

/// The plan the database makes for the exact query [`expired`] runs, one line per node.
fn scan_plan(connection: &mut Conn) -> Result<Vec<String>, store::Error> {
    use diesel::sql_types::{Integer, Text};
    match connection {
        Conn::Sqlite(c) => {
            // EXPLAIN QUERY PLAN answers (id, parent, notused, detail).
            let plan = Explain::<_, (Integer, Integer, Integer, Text)>::new(
                "EXPLAIN QUERY PLAN ",
                scan!(NOW),
            )
            .load::<(i32, i32, i32, String)>(c)?;
            Ok(plan.into_iter().map(|(_, _, _, detail)| detail).collect())
        }
        Conn::Pg(c) => {
            // The tables are nearly empty, so the planner would rather read them whole;
            // without that option it shows whether the index can serve the scan.
            diesel::sql_query("SET enable_seqscan = off").execute(c)?;
            let plan = Explain::<_, Text>::new("EXPLAIN ", scan!(NOW)).load::<String>(c);
            diesel::sql_query("RESET enable_seqscan").execute(c)?;
            Ok(plan?)
        }
    }
}

#[tokio::test]
async fn the_recovery_scan_reads_its_batch_off_the_recovery_scan_index_on_sqlite() {
    let (fixture, _) = selected().await;
    let plan = fixture.store.read(scan_plan).await.unwrap();
    assert!(
        plan.iter()
            .any(|line| line.contains("USING INDEX session_execution_recovery_scan_idx")),
        "{plan:?}"
    );
    // The index's order is the batch's order: no sort after the read.
    assert!(
        !plan.iter().any(|line| line.contains("TEMP B-TREE")),
        "{plan:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recovery_scan_reads_its_batch_off_the_recovery_scan_index_on_postgres() {
    let Some(db) = Postgres::create() else {
        return;
    };
    let store = Store::open(DbUrl::Postgres(db.url.clone()), Options::default())
        .await
        .unwrap();
    let plan = store.read(scan_plan).await.unwrap();
    assert!(
        plan.iter()
            .any(|line| line.contains("using session_execution_recovery_scan_idx")),
        "{plan:?}"
    );
}

/// A fresh database on the PostgreSQL server `KEEL_TEST_POSTGRES_URL` names, dropped
/// with this; `None` without that variable (the store suite says the same).
struct Postgres {
    base: String,
    name: String,
    url: String,
}

impl Postgres {
    fn create() -> Option<Self> {
        use diesel::Connection;
        let base = std::env::var("KEEL_TEST_POSTGRES_URL").ok()?;
        let name = format!(
            "keel_unit_{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        );
        let mut admin = diesel::PgConnection::establish(&base).unwrap();
        diesel::sql_query(format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .unwrap();
        let (prefix, _) = base.rsplit_once('/').unwrap();
        let url = format!("{prefix}/{name}");
        Some(Self { base, name, url })
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        use diesel::Connection;
        let dropped = diesel::PgConnection::establish(&self.base).map(|mut admin| {
            diesel::sql_query(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .execute(&mut admin)
        });
        if let Err(e) = dropped {
            eprintln!("dropping test database {}: {e}", self.name);
        }
    }
}

/// A session whose step `assistant` is open under an expired claim in phase `running`,
/// and a pass's selection of that claim.
async fn selected_running() -> (Fixture, Candidate, MessageId) {
    let (fixture, _) = selected().await;
    let session = fixture.session;
    let assistant = MessageId::new();
    fixture
        .store
        .write(move |c| {
            log::append(c, NOW, session, vec![step_started(assistant, 1)])?;
            diesel::update(session_execution::table)
                .set((
                    session_execution::assistant_message_id.eq(assistant.to_string()),
                    session_execution::phase.eq("running"),
                ))
                .execute(c)?;
            Ok::<_, store::Error>(())
        })
        .await
        .unwrap();
    let mut candidates = fixture.store.read(|c| expired(c, NOW)).await.unwrap();
    assert_eq!(candidates.len(), 1);
    (fixture, candidates.remove(0), assistant)
}

fn step_started(assistant: MessageId, step: u32) -> DurableEvent {
    DurableEvent::StepStarted(payload::StepStarted {
        assistant_message_id: assistant,
        step,
        agent: "build".into(),
        model: ModelRef {
            provider: "p".into(),
            id: "m".into(),
        },
    })
}

/// The session's inputs (id, source) and its event types.
async fn inputs_and_events(
    store: &Store,
    session: SessionId,
) -> (Vec<(String, String)>, Vec<String>) {
    store
        .read(move |c| {
            let inputs = session_input::table
                .select((session_input::id, session_input::source))
                .load::<(String, String)>(c)?;
            let events = event::table
                .filter(event::session_id.eq(session.to_string()))
                .order(event::seq)
                .select(event::type_name)
                .load::<String>(c)?;
            Ok::<_, store::Error>((inputs, events))
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn a_newer_assistant_appearing_between_selection_and_validation_quarantines_the_claim_without_a_continuation()
 {
    let (fixture, candidate, first) = selected_running().await;
    let session = fixture.session;
    // The claim stays exactly as selected (a fenced write would have renewed it), yet a
    // newer step shows up in the log.
    fixture
        .store
        .write(move |c| {
            log::append(
                c,
                NOW,
                session,
                vec![
                    DurableEvent::StepEnded(payload::StepEnded {
                        assistant_message_id: first,
                        finish: keel_schema::types::Finish::Stop,
                        usage: keel_schema::types::Usage::default(),
                        cost: 0.0,
                    }),
                    step_started(MessageId::new(), 2),
                ],
            )
        })
        .await
        .unwrap();
    let (_, before) = inputs_and_events(&fixture.store, session).await;

    let recovered = fixture
        .store
        .write(move |c| recover(c, NOW, &candidate))
        .await
        .unwrap();
    let Recovered::Quarantine(reason) = recovered else {
        panic!("the claim was not quarantined");
    };
    assert!(
        reason.contains("superseded by a newer assistant"),
        "{reason}"
    );
    let error = fixture
        .store
        .read(|c| {
            session_execution::table
                .select(session_execution::recovery_error)
                .first::<Option<String>>(c)
                .map_err(store::Error::from)
        })
        .await
        .unwrap();
    assert_eq!(error, Some(reason));
    // Nothing was settled, and no continuation exists that anything could promote.
    let (inputs, after) = inputs_and_events(&fixture.store, session).await;
    assert!(inputs.is_empty(), "{inputs:?}");
    assert_eq!(after, before);
}

#[tokio::test]
async fn an_assistant_less_claim_replaced_before_validation_is_left_alone_and_its_replacement_recovered_once()
 {
    let (fixture, candidate) = selected().await;
    let session = fixture.session;
    let replacement = ExecutionId::new();
    fixture
        .store
        .write(move |c| {
            diesel::delete(session_execution::table).execute(c)?;
            // Another owner claimed the session and died before its first step.
            claim(c, session, replacement, NOW - 1)
        })
        .await
        .unwrap();
    let stale = fixture
        .store
        .write(move |c| recover(c, NOW, &candidate))
        .await
        .unwrap();
    assert!(
        matches!(stale, Recovered::Moved),
        "left alone, not quarantined"
    );

    // The next pass finds the replacement and settles it, without a continuation.
    let candidates = fixture.store.read(|c| expired(c, NOW)).await.unwrap();
    assert_eq!(
        candidates.iter().map(|c| c.id.clone()).collect::<Vec<_>>(),
        vec![replacement.to_string()]
    );
    let fresh = candidates[0].clone();
    let recovered = fixture
        .store
        .write(move |c| recover(c, NOW, &fresh))
        .await
        .unwrap();
    assert!(matches!(recovered, Recovered::Continued(s, _) if s == session));
    let (inputs, events) = inputs_and_events(&fixture.store, session).await;
    assert!(inputs.is_empty(), "{inputs:?}");
    assert_eq!(
        events,
        ["session.next.created", "session.next.execution.settled"]
    );
    assert!(
        fixture
            .store
            .read(|c| expired(c, NOW))
            .await
            .unwrap()
            .is_empty()
    );
}
