//! Several nodes on one database: the `node` table and the LISTEN/NOTIFY bus between nodes.
//!
//! Every `keel serve` process is a node: it registers in the `node` table at start,
//! heartbeats every third of a lease, and removes itself on a graceful shutdown; nodes
//! silent for three leases are dropped from the list (their claims are recovery's
//! business, not this table's). `GET /api/nodes` lists the live ones.
//!
//! On PostgreSQL the nodes also talk through LISTEN/NOTIFY ([`Bus`]), on one dedicated
//! connection per node:
//! - `keel_log`: each node forwards the ranges of durable events it committed (`node
//!   session first last`); the others read those events from the log and publish them to
//!   their own streams, so a client may follow any session through any node. A notification
//!   lost to a broken connection costs latency, not events: log streams re-read the log
//!   periodically.
//! - `keel_route`: a wake or an interrupt for a session whose claim another node holds
//!   goes to that node (`{"to", "session", "kind"}`), which carries it out as if it had
//!   been asked directly. A wake for a session nobody holds is taken locally. (A reply to
//!   a permission request or a question is committed by the node that receives it; its
//!   wake travels like any other.) An interrupt is recorded on the claim before it is
//!   sent ([`crate::execution::request_cancel`]): the message only makes the owner stop
//!   sooner than its next lease renewal, which finds the interrupt anyway.
//!
//! A notification that could not be sent (the connection broke) is sent again on the
//! next connection, in order, before anything queued after it.
//!
//! The connection is polled every [`POLL`]: libpq's notifications arrive on its socket,
//! which diesel does not expose for waiting, and a 20 ms poll costs one non-blocking read.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::Text;
use keel_schema::api;
use keel_schema::id::{ExecutionId, OwnerId, SessionId};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::coordinator::Scope;
use crate::runner::{Forwarder, Live, Runner};
use crate::store::Direct as _;
use crate::store::schema::{node, session_execution};
use crate::store::{self, Conn, Store};

/// How often the bus connection is polled for notifications and outgoing messages.
pub const POLL: Duration = Duration::from_millis(20);

/// The channel of committed events.
const LOG_CHANNEL: &str = "keel_log";

/// The channel of routed wakes, interrupts and replies.
const ROUTE_CHANNEL: &str = "keel_route";

/// The longest notification payload: PostgreSQL's limit is 8000 bytes.
const MAX_PAYLOAD: usize = 7_900;

/// Why the cluster bus could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the cluster bus thread could not start: {0}")]
    Spawn(#[source] std::io::Error),
}

/// What a node says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub owner: OwnerId,
    pub host: String,
    pub pid: u32,
    pub started_at: i64,
}

impl NodeInfo {
    /// This process, started now.
    pub fn this_process(owner: OwnerId, now: i64) -> Self {
        let host = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty())
            .or_else(|| {
                std::fs::read_to_string("/etc/hostname")
                    .ok()
                    .map(|h| h.trim().to_owned())
            })
            .unwrap_or_else(|| "localhost".into());
        Self {
            owner,
            host,
            pid: std::process::id(),
            started_at: now,
        }
    }
}

/// Registers `info` (or refreshes its row).
pub fn register(connection: &mut Conn, now: i64, info: &NodeInfo) -> Result<(), store::Error> {
    let row = (
        node::owner_id.eq(info.owner.to_string()),
        node::host.eq(&info.host),
        node::pid.eq(i64::from(info.pid)),
        node::started_at.eq(info.started_at),
        node::heartbeat_at.eq(now),
    );
    diesel::delete(node::table.filter(node::owner_id.eq(info.owner.to_string())))
        .execute(connection)?;
    diesel::insert_into(node::table)
        .values(row)
        .execute(connection)?;
    Ok(())
}

/// Records a heartbeat of `owner` and drops nodes silent since `silent_since`. False when
/// the node's row was gone (another node dropped it after a long pause): then it must
/// register again.
pub fn heartbeat(
    connection: &mut Conn,
    now: i64,
    owner: OwnerId,
    silent_since: i64,
) -> Result<bool, store::Error> {
    let updated = diesel::update(node::table.filter(node::owner_id.eq(owner.to_string())))
        .set(node::heartbeat_at.eq(now))
        .execute(connection)?;
    diesel::delete(node::table.filter(node::heartbeat_at.lt(silent_since))).execute(connection)?;
    Ok(updated == 1)
}

/// Removes `owner` from the table (a graceful shutdown).
pub fn unregister(connection: &mut Conn, owner: OwnerId) -> Result<(), store::Error> {
    diesel::delete(node::table.filter(node::owner_id.eq(owner.to_string()))).execute(connection)?;
    Ok(())
}

/// The nodes that heartbeat since `alive_since`, with the sessions each owns now.
pub fn list(connection: &mut Conn, alive_since: i64) -> Result<Vec<api::Node>, store::Error> {
    let rows: Vec<NodeRow> = node::table
        .filter(node::heartbeat_at.ge(alive_since))
        .order(node::started_at.asc())
        .select(NodeRow::as_select())
        .load(connection)?;
    let owners: Vec<String> = session_execution::table
        .select(session_execution::owner_id)
        .load_direct(connection)?;
    rows.into_iter()
        .map(|row| {
            let sessions = owners.iter().filter(|o| **o == row.owner_id).count();
            Ok(api::Node {
                id: row
                    .owner_id
                    .parse()
                    .map_err(|e| store::Error::Corrupt(format!("node id {}: {e}", row.owner_id)))?,
                host: row.host,
                pid: u32::try_from(row.pid).unwrap_or(0),
                started_at: row.started_at,
                heartbeat_at: row.heartbeat_at,
                sessions: u32::try_from(sessions).unwrap_or(u32::MAX),
            })
        })
        .collect()
}

/// A row of `node`.
#[derive(Debug, Queryable, Selectable)]
#[diesel(table_name = node)]
struct NodeRow {
    owner_id: String,
    host: String,
    pid: i64,
    started_at: i64,
    heartbeat_at: i64,
}

/// Heartbeats `info` every third of a lease until `shutdown`, then unregisters it.
pub async fn keep_registered(
    store: Store,
    info: NodeInfo,
    lease_ms: i64,
    shutdown: CancellationToken,
) {
    let period = Duration::from_millis(u64::try_from(lease_ms / 3).unwrap_or(1).max(1));
    loop {
        let now = store.clock().now_ms();
        let owner = info.owner;
        let beat = store
            .write(move |c| heartbeat(c, now, owner, now - 3 * lease_ms))
            .await;
        let registered = match beat {
            Ok(true) => Ok(()),
            Ok(false) => {
                let info = info.clone();
                store.write(move |c| register(c, now, &info)).await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = registered {
            tracing::warn!(error = %e, "the node heartbeat failed; retrying next period");
        }
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(period) => {}
        }
    }
    let owner = info.owner;
    if let Err(e) = store.write(move |c| unregister(c, owner)).await {
        tracing::warn!(error = %e, "the node could not unregister");
    }
}

/// What a routed message asks of its node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteKind {
    Wake,
    Interrupt,
}

/// A wake or interrupt for the node that holds a session's claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    pub to: OwnerId,
    pub session: SessionId,
    pub kind: RouteKind,
    /// For an interrupt: the execution it stops, so a late or repeated message never
    /// stops the session's next one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution: Option<ExecutionId>,
}

/// A notification for the bus thread to send.
#[derive(Debug)]
struct Outgoing {
    channel: &'static str,
    payload: String,
}

/// The node's end of LISTEN/NOTIFY (PostgreSQL only).
#[derive(Debug, Clone)]
pub struct Bus {
    outgoing: mpsc::Sender<Outgoing>,
    /// Whether the bus thread is listening now.
    connected: Arc<AtomicBool>,
}

impl Bus {
    /// Starts the bus thread on its own connection to `url`, and the task that forwards
    /// this node's commits. Runs until `shutdown`.
    pub fn start(
        url: String,
        runner: Runner,
        store: Store,
        shutdown: CancellationToken,
    ) -> Result<Self, Error> {
        let (outgoing, queue) = mpsc::channel();
        let connected = Arc::new(AtomicBool::new(false));
        let bus = Self {
            outgoing,
            connected: connected.clone(),
        };
        let handle = tokio::runtime::Handle::current();
        let receiver = Receiver {
            connected,
            owner: runner.owner(),
            runner: runner.clone(),
            store,
            handle,
        };
        let stop = shutdown.clone();
        std::thread::Builder::new()
            .name("keel-bus".into())
            .spawn(move || receiver.run(&url, &queue, &stop))
            .map_err(Error::Spawn)?;
        tokio::spawn(forward_commits(bus.clone(), runner, shutdown));
        Ok(bus)
    }

    /// Forwards `route` to the node it names. Fails when it does not fit in a
    /// notification.
    pub fn forward(&self, route: &Route) -> Result<(), String> {
        let payload = serde_json::to_string(route).map_err(|e| e.to_string())?;
        if payload.len() > MAX_PAYLOAD {
            return Err(format!(
                "the message is {} bytes; at most {MAX_PAYLOAD} can go to another node",
                payload.len()
            ));
        }
        self.notify(ROUTE_CHANNEL, payload);
        Ok(())
    }

    /// Whether the node is listening for the other nodes now (`GET /api/ready`).
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::SeqCst)
    }

    /// Hands a notification to the bus thread.
    fn notify(&self, channel: &'static str, payload: String) {
        // The thread is gone only at shutdown.
        drop(self.outgoing.send(Outgoing { channel, payload }));
    }
}

impl Forwarder for Bus {
    fn forward_wake(&self, owner: OwnerId, session: SessionId) {
        let wake = Route {
            to: owner,
            session,
            kind: RouteKind::Wake,
            execution: None,
        };
        if let Err(e) = self.forward(&wake) {
            tracing::error!(error = %e, "a wake could not be routed");
        }
    }

    fn forward_interrupt(&self, owner: OwnerId, session: SessionId, execution: ExecutionId) {
        let interrupt = Route {
            to: owner,
            session,
            kind: RouteKind::Interrupt,
            execution: Some(execution),
        };
        if let Err(e) = self.forward(&interrupt) {
            tracing::error!(error = %e, "an interrupt could not be routed");
        }
    }
}

/// Forwards this node's commits on `keel_log`, one range per session and burst.
async fn forward_commits(bus: Bus, runner: Runner, shutdown: CancellationToken) {
    let owner = runner.owner();
    let mut live = runner.subscribe();
    loop {
        let first = tokio::select! {
            () = shutdown.cancelled() => return,
            item = live.recv() => item,
        };
        let mut ranges: BTreeMap<SessionId, (u64, u64)> = BTreeMap::new();
        let mut note = |item: Result<Live, broadcast::error::RecvError>| match item {
            Ok(Live::Durable(envelope)) => {
                let range = ranges
                    .entry(envelope.session_id)
                    .or_insert((envelope.seq, envelope.seq));
                range.0 = range.0.min(envelope.seq);
                range.1 = range.1.max(envelope.seq);
                true
            }
            Ok(_) => true,
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                // The other nodes' streams re-read the log periodically; they are late,
                // not wrong.
                tracing::warn!(missed, "commits were not forwarded to the other nodes");
                true
            }
            Err(broadcast::error::RecvError::Closed) => false,
        };
        if !note(first) {
            return;
        }
        while let Ok(item) = live.try_recv() {
            note(Ok(item));
        }
        for (session, (first, last)) in ranges {
            bus.notify(LOG_CHANNEL, format!("{owner} {session} {first} {last}"));
        }
    }
}

/// Sends `unsent` in order; a notification leaves the queue only once it was sent, so
/// one that fails is first in line on the next connection.
fn send(
    connection: &mut PgConnection,
    unsent: &mut VecDeque<Outgoing>,
) -> Result<(), diesel::result::Error> {
    while let Some(outgoing) = unsent.front() {
        diesel::sql_query("SELECT pg_notify($1, $2)")
            .bind::<Text, _>(outgoing.channel)
            .bind::<Text, _>(&outgoing.payload)
            .execute(connection)?;
        unsent.pop_front();
    }
    Ok(())
}

/// The bus thread's state.
struct Receiver {
    connected: Arc<AtomicBool>,
    owner: OwnerId,
    runner: Runner,
    store: Store,
    handle: tokio::runtime::Handle,
}

impl Receiver {
    fn run(self, url: &str, queue: &mpsc::Receiver<Outgoing>, shutdown: &CancellationToken) {
        // Notifications taken from the queue and not sent yet.
        let mut unsent = VecDeque::new();
        while !shutdown.is_cancelled() {
            match self.connect(url) {
                Ok(mut connection) => {
                    tracing::info!("listening for the other nodes");
                    self.connected.store(true, Ordering::SeqCst);
                    let served = self.serve(&mut connection, queue, &mut unsent, shutdown);
                    self.connected.store(false, Ordering::SeqCst);
                    if let Err(e) = served {
                        tracing::warn!(error = %e, "the bus connection failed; reconnecting");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "the bus cannot connect; retrying"),
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    fn connect(&self, url: &str) -> Result<PgConnection, diesel::result::Error> {
        let mut connection = PgConnection::establish(url).map_err(|e| {
            diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::UnableToSendCommand,
                Box::new(e.to_string()),
            )
        })?;
        diesel::sql_query(format!("LISTEN {LOG_CHANNEL}")).execute(&mut connection)?;
        diesel::sql_query(format!("LISTEN {ROUTE_CHANNEL}")).execute(&mut connection)?;
        Ok(connection)
    }

    fn serve(
        &self,
        connection: &mut PgConnection,
        queue: &mpsc::Receiver<Outgoing>,
        unsent: &mut VecDeque<Outgoing>,
        shutdown: &CancellationToken,
    ) -> Result<(), diesel::result::Error> {
        while !shutdown.is_cancelled() {
            unsent.extend(queue.try_iter());
            send(connection, unsent)?;
            let received: Vec<_> = connection.notifications_iter().collect::<Result<_, _>>()?;
            for notification in received {
                match notification.channel.as_str() {
                    LOG_CHANNEL => self.committed(&notification.payload),
                    ROUTE_CHANNEL => self.routed(&notification.payload),
                    _ => {}
                }
            }
            std::thread::sleep(POLL);
        }
        Ok(())
    }

    /// Another node committed events: publish them here too.
    fn committed(&self, payload: &str) {
        let mut fields = payload.split(' ');
        let (Some(origin), Some(session), Some(first), Some(last)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            tracing::warn!(payload, "an unreadable commit notice");
            return;
        };
        if origin == self.owner.to_string() {
            return;
        }
        let (Ok(session), Ok(first), Ok(last)) = (
            session.parse::<SessionId>(),
            first.parse::<u64>(),
            last.parse::<u64>(),
        ) else {
            tracing::warn!(payload, "an unreadable commit notice");
            return;
        };
        let (store, runner) = (self.store.clone(), self.runner.clone());
        let count = u32::try_from(last.saturating_sub(first) + 1).unwrap_or(u32::MAX);
        self.handle.spawn(async move {
            match store
                .read_log(session, first.saturating_sub(1), count)
                .await
            {
                Ok(envelopes) => runner.publish_remote(&envelopes),
                Err(e) => {
                    tracing::warn!(%session, error = %e, "reading another node's commits failed")
                }
            }
        });
    }

    /// A wake or an interrupt for this node.
    fn routed(&self, payload: &str) {
        let route: Route = match serde_json::from_str(payload) {
            Ok(route) => route,
            Err(e) => {
                tracing::warn!(payload, error = %e, "an unreadable route");
                return;
            }
        };
        if route.to != self.owner {
            return;
        }
        let runner = self.runner.clone();
        self.handle.spawn(async move {
            match route.kind {
                RouteKind::Wake => runner.wake(route.session, Scope::Input),
                // The sender recorded the interrupt on the claim before sending it.
                RouteKind::Interrupt => {
                    if let Some(execution) = route.execution {
                        runner.stop_cancelled(route.session, execution);
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection to the test server, or `None` (the test is skipped, as the store
    /// suite says) without `KEEL_TEST_POSTGRES_URL`.
    fn connect() -> Option<PgConnection> {
        let Ok(url) = std::env::var("KEEL_TEST_POSTGRES_URL") else {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("KEEL_TEST_POSTGRES_URL must be set in CI");
            }
            eprintln!("note: skipped: set KEEL_TEST_POSTGRES_URL to run this PostgreSQL test");
            return None;
        };
        Some(PgConnection::establish(&url).unwrap())
    }

    #[test]
    fn a_notification_that_could_not_be_sent_is_sent_first_on_the_next_connection() {
        let Some(mut listener) = connect() else {
            return;
        };
        let channel = "keel_test_unsent";
        diesel::sql_query(format!("LISTEN {channel}"))
            .execute(&mut listener)
            .unwrap();
        let outgoing = |payload: &str| Outgoing {
            channel,
            payload: payload.to_owned(),
        };
        let mut unsent: VecDeque<Outgoing> = [outgoing("first"), outgoing("second")].into();

        // The connection breaks before the first notification goes out.
        let mut broken = connect().unwrap();
        #[derive(QueryableByName)]
        struct Pid {
            #[diesel(sql_type = diesel::sql_types::Integer)]
            pid: i32,
        }
        let Pid { pid } = diesel::sql_query("SELECT pg_backend_pid() AS pid")
            .get_result(&mut broken)
            .unwrap();
        diesel::sql_query(format!("SELECT pg_terminate_backend({pid})"))
            .execute(&mut listener)
            .unwrap();
        assert!(send(&mut broken, &mut unsent).is_err());
        assert_eq!(unsent.len(), 2, "nothing is dropped with the connection");

        // The next connection sends both, in order.
        send(&mut connect().unwrap(), &mut unsent).unwrap();
        assert!(unsent.is_empty());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut received = Vec::new();
        while received.len() < 2 && std::time::Instant::now() < deadline {
            for notification in listener.notifications_iter() {
                received.push(notification.unwrap().payload);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(received, ["first", "second"]);
    }
}
