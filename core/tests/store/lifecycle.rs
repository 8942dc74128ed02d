//! One full prompt lifecycle, written the way the runner will write it, and a dump of
//! every row it projects.

use diesel::prelude::*;
use keel_core::inbox::{self, Admission, Boundary, Promotion};
use keel_core::store::schema::{
    context_epoch, session, session_input, session_message, session_request, session_tool,
};
use keel_core::store::{Conn, Store};
use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::{CallId, ExecutionId, InputId, MessageId, OwnerId, SessionId};
use keel_schema::types::{Delivery, Effect, ErrorInfo, Finish, Outcome, Part, ToolContent, Usage};
use serde_json::json;

use crate::support::{created, model};

pub fn usage(input: u64, output: u64) -> Usage {
    Usage {
        input,
        output,
        reasoning: 7,
        cache_read: 100,
        cache_write: 3,
    }
}

/// Writes a session through a whole prompt: admission, execution, a step with text and two
/// tool calls (one succeeds, one fails), a second step with reasoning and text, settlement;
/// plus a renamed title and a second input that is cancelled. Returns the session id.
pub async fn write(store: &Store) -> SessionId {
    let session = SessionId::new();
    let owner = OwnerId::new();
    let execution = ExecutionId::new();
    let first = MessageId::new();
    let second = MessageId::new();
    let read_call = CallId::new();
    let write_call = CallId::new();
    let refused = keel_schema::id::RequestId::new();

    store
        .append(session, vec![created("lifecycle")])
        .await
        .unwrap();
    let admitted = admit(store, session, "Why does test_login fail?", Delivery::Queue).await;
    let cancelled = admit(store, session, "never mind", Delivery::Queue).await;
    let clock = store.clock().clone();
    store
        .write(move |c| inbox::cancel(c, clock.now_ms(), session, cancelled))
        .await
        .unwrap();
    store
        .append(
            session,
            vec![DurableEvent::ExecutionStarted(payload::ExecutionStarted {
                execution_id: execution,
                owner_id: owner,
            })],
        )
        .await
        .unwrap();
    let clock = store.clock().clone();
    let promoted = store
        .write(move |c| inbox::promote(c, clock.now_ms(), session, Boundary::Idle))
        .await
        .unwrap();
    assert!(
        matches!(&promoted, Promotion::Prompts(p) if p.len() == 1 && p[0].0 == admitted),
        "{promoted:?}"
    );

    store
        .append(
            session,
            vec![
                DurableEvent::ContextEpochStarted(payload::ContextEpochStarted {
                    epoch: 1,
                    system: "You are a careful engineer.".into(),
                    baseline_seq: 0,
                }),
                DurableEvent::StepStarted(payload::StepStarted {
                    assistant_message_id: first,
                    step: 1,
                    agent: "build".into(),
                    model: model(),
                }),
                DurableEvent::TextStarted(payload::TextStarted {
                    assistant_message_id: first,
                    ordinal: 0,
                }),
                DurableEvent::TextEnded(payload::TextEnded {
                    assistant_message_id: first,
                    ordinal: 0,
                    text: "Let me look.".into(),
                }),
                DurableEvent::ToolInputStarted(payload::ToolInputStarted {
                    assistant_message_id: first,
                    call_id: read_call,
                    name: "read".into(),
                }),
                DurableEvent::ToolInputEnded(payload::ToolInputEnded {
                    assistant_message_id: first,
                    call_id: read_call,
                    text: r#"{"path":"tests/login.rs"}"#.into(),
                }),
                DurableEvent::ToolCalled(payload::ToolCalled {
                    assistant_message_id: first,
                    call_id: read_call,
                    name: "read".into(),
                    input: json!({"path": "tests/login.rs"}),
                    provider_executed: false,
                    effect: Effect::Read,
                    provider_call_id: Some("call_a".into()),
                    rerun: false,
                }),
                DurableEvent::ToolCalled(payload::ToolCalled {
                    assistant_message_id: first,
                    call_id: write_call,
                    name: "write".into(),
                    input: json!({"path": "tests/login.rs", "content": "fixed"}),
                    provider_executed: false,
                    effect: Effect::Write,
                    provider_call_id: Some("call_b".into()),
                    rerun: false,
                }),
                // The write waits for a person, who refuses it.
                DurableEvent::PermissionRequested(payload::PermissionRequested {
                    request_id: refused,
                    call_id: write_call,
                    tool: "write".into(),
                    pattern: "tests/login.rs".into(),
                    rule: None,
                }),
                DurableEvent::PermissionReplied(payload::PermissionReplied {
                    request_id: refused,
                    decision: keel_schema::types::Decision::Reject,
                }),
            ],
        )
        .await
        .unwrap();
    store
        .append(
            session,
            vec![
                DurableEvent::ToolSuccess(payload::ToolSuccess {
                    call_id: read_call,
                    structured: json!({"lines": 2}),
                    content: vec![ToolContent::Text {
                        text: "1: #[test]\n2: fn login() {}".into(),
                    }],
                    result: None,
                }),
                DurableEvent::ToolFailed(payload::ToolFailed {
                    call_id: write_call,
                    error: ErrorInfo::new("tool.permission", "writing tests/ is not allowed"),
                }),
                DurableEvent::StepEnded(payload::StepEnded {
                    assistant_message_id: first,
                    finish: Finish::ToolCalls,
                    usage: usage(1000, 50),
                    cost: 0.25,
                }),
            ],
        )
        .await
        .unwrap();
    store
        .append(
            session,
            vec![
                // The agent's prompt changed between the steps.
                DurableEvent::ContextSystemUpdated(payload::ContextSystemUpdated {
                    message_id: MessageId::new(),
                    system: "You are a careful engineer who explains every change.".into(),
                }),
                DurableEvent::StepStarted(payload::StepStarted {
                    assistant_message_id: second,
                    step: 2,
                    agent: "build".into(),
                    model: model(),
                }),
                DurableEvent::ReasoningStarted(payload::ReasoningStarted {
                    assistant_message_id: second,
                    ordinal: 0,
                    provider_metadata: None,
                }),
                DurableEvent::ReasoningEnded(payload::ReasoningEnded {
                    assistant_message_id: second,
                    ordinal: 0,
                    text: "The clock is read twice.".into(),
                    provider_metadata: Some(json!({"signature": "sig"})),
                }),
                DurableEvent::TextStarted(payload::TextStarted {
                    assistant_message_id: second,
                    ordinal: 0,
                }),
                DurableEvent::TextEnded(payload::TextEnded {
                    assistant_message_id: second,
                    ordinal: 0,
                    text: "Pin the clock.".into(),
                }),
                DurableEvent::StepEnded(payload::StepEnded {
                    assistant_message_id: second,
                    finish: Finish::Stop,
                    usage: usage(1200, 20),
                    cost: 0.5,
                }),
                DurableEvent::ExecutionSettled(payload::ExecutionSettled {
                    execution_id: execution,
                    outcome: Outcome::Succeeded,
                    error: None,
                }),
                DurableEvent::Renamed(payload::Renamed {
                    title: "Flaky login test".into(),
                }),
            ],
        )
        .await
        .unwrap();
    session
}

/// Admits a text prompt with execution requested; returns its id.
pub async fn admit(store: &Store, session: SessionId, text: &str, delivery: Delivery) -> InputId {
    let clock = store.clock().clone();
    let admission = Admission {
        delivery,
        ..Admission::prompt(vec![Part::Text { text: text.into() }])
    };
    store
        .write(move |c| inbox::admit(c, clock.now_ms(), session, admission.clone()))
        .await
        .unwrap()
        .input
        .id
}

type SessionRow = (
    String,
    Option<String>,
    String,
    String,
    String,
    String,
    i64,
    i64,
    i64,
    (i64, i64, i64, i64, i64),
    f64,
    Option<i64>,
);

/// call id, message id, name, effect, status, provider_executed, input, output.
pub type ToolRow = (
    String,
    String,
    String,
    Option<String>,
    String,
    bool,
    Option<String>,
    Option<String>,
);

/// Every projected row of a session, in a stable order.
#[derive(Debug, PartialEq)]
pub struct Rows {
    pub session: Vec<SessionRow>,
    pub messages: Vec<(String, i64, String, serde_json::Value)>,
    pub tools: Vec<ToolRow>,
    pub inputs: Vec<keel_core::event::view::InputRow>,
    /// id, call id, kind, tool, asked seq, state, reply, always.
    pub requests: Vec<RequestRow>,
    /// epoch, baseline seq, system, effective system.
    pub epoch: Vec<(i64, i64, String, String)>,
}

pub type RequestRow = (
    String,
    String,
    String,
    String,
    i64,
    String,
    Option<String>,
    bool,
    String,
    Option<String>,
);

/// Replays `session`'s log from `store` into a fresh SQLite database and checks that
/// it projects every row `store` holds for the session, exactly.
pub async fn assert_replay_projects_the_same_rows(store: &Store, session: SessionId) {
    let target_db = crate::support::TestDb::sqlite();
    let target = target_db.open().await;
    keel_core::event::replay::session(store, &target, session)
        .await
        .unwrap();
    let dump = |store: Store| async move {
        store
            .read(move |c| Ok::<_, keel_core::store::Error>(rows(c, session)))
            .await
            .unwrap()
    };
    assert_eq!(dump(store.clone()).await, dump(target).await, "{session}");
}

pub fn rows(connection: &mut Conn, id: SessionId) -> Rows {
    let id = id.to_string();
    let session = session::table
        .filter(session::id.eq(&id))
        .select((
            session::id,
            session::title,
            session::directory,
            session::agent,
            session::model_provider,
            session::model_id,
            session::time_created,
            session::time_updated,
            session::last_seq,
            (
                session::usage_input,
                session::usage_output,
                session::usage_reasoning,
                session::usage_cache_read,
                session::usage_cache_write,
            ),
            session::cost,
            session::deleted_at,
        ))
        .load(connection)
        .unwrap();
    let messages: Vec<(String, i64, String, String)> = session_message::table
        .filter(session_message::session_id.eq(&id))
        .order(session_message::seq)
        .select((
            session_message::id,
            session_message::seq,
            session_message::role,
            session_message::data,
        ))
        .load(connection)
        .unwrap();
    let messages = messages
        .into_iter()
        .map(|(id, seq, role, data)| (id, seq, role, serde_json::from_str(&data).unwrap()))
        .collect();
    let tools = session_tool::table
        .filter(session_tool::session_id.eq(&id))
        .order(session_tool::call_id)
        .select((
            session_tool::call_id,
            session_tool::message_id,
            session_tool::name,
            session_tool::effect,
            session_tool::status,
            session_tool::provider_executed,
            session_tool::input,
            session_tool::output,
        ))
        .load(connection)
        .unwrap();
    let inputs = session_input::table
        .filter(session_input::session_id.eq(&id))
        .order(session_input::admitted_seq)
        .select(keel_core::event::view::InputRow::as_select())
        .load(connection)
        .unwrap();
    let requests = session_request::table
        .filter(session_request::session_id.eq(&id))
        .order(session_request::asked_seq)
        .select((
            session_request::id,
            session_request::call_id,
            session_request::kind,
            session_request::tool,
            session_request::asked_seq,
            session_request::state,
            session_request::reply,
            session_request::always,
            session_request::pattern,
            session_request::rule,
        ))
        .load(connection)
        .unwrap();
    let epoch = context_epoch::table
        .filter(context_epoch::session_id.eq(&id))
        .select((
            context_epoch::epoch,
            context_epoch::baseline_seq,
            context_epoch::system,
            context_epoch::effective_system,
        ))
        .load(connection)
        .unwrap();
    Rows {
        session,
        messages,
        tools,
        inputs,
        requests,
        epoch,
    }
}
