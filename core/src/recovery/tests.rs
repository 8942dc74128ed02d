//! The compare-and-set between selection and recovery: a claim that changed after a
//! pass selected it is neither recovered nor quarantined. (Whole passes are tested in
//! `core/tests/runner/recovery.rs`.)

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
