//! Replay: rebuilding a session's projections from its log.
//!
//! Every projected row is a pure function of the log, so importing a session's events
//! into an empty database reproduces its `session`, `session_message`, `session_tool` and
//! `session_input` rows exactly.

use keel_schema::id::SessionId;

use super::log;
use crate::store::{Error, Store};

/// How many events are read and imported at a time.
const PAGE: u32 = 1_000;

/// Copies `session`'s log from `source` into `target` (where the session must not exist
/// yet), projecting every event there. Returns how many events were replayed.
pub async fn session(source: &Store, target: &Store, session_id: SessionId) -> Result<u64, Error> {
    let mut after = 0;
    loop {
        let page = source.read_log(session_id, after, PAGE).await?;
        let Some(last) = page.last() else {
            break;
        };
        after = last.seq;
        target
            .write_for(session_id, move |c| log::import(c, &page))
            .await?;
    }
    Ok(after)
}
