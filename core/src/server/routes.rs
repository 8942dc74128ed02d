//! The JSON routes.

use std::time::Duration;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use diesel::RunQueryDsl;
use keel_schema::api::{
    Accepted, AgentInfo, AgentList, CreateSession, ErrorType, ExecutionStatus, Health,
    InterruptResponse, ListSessionsQuery, McpServer, McpServerList, McpState, McpTool, MessageList,
    NodeList, PermissionReply, PromptRequest, PromptResponse, QuestionReply, Ready, Session,
    SessionList, SessionStatus, UpdateSession,
};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{OwnerId, RequestId, SessionId};
use keel_schema::types::{Delivery, InputKind, InputSource, ModelRef};

use super::extract::{Body, ExistingSession, RequestPath, existing};
use super::{ApiError, AppState};
use crate::cluster;
use crate::coordinator::Scope;
use crate::event::{log, view};
use crate::execution;
use crate::inbox::{self, Admission, Admitted};
use crate::request::{self, Reply};
use crate::runner;
use crate::store;
use crate::store::Direct as _;

type Result<T> = std::result::Result<T, ApiError>;

pub async fn health() -> Json<Health> {
    Json(Health {
        ok: true,
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

/// How long each readiness check may take.
const READY_WITHIN: Duration = Duration::from_secs(2);

pub async fn ready(State(state): State<AppState>) -> Result<Json<Ready>> {
    let unavailable = |what: &str, why: &dyn std::fmt::Display| {
        ApiError::new(ErrorType::Unavailable, format!("{what}: {why}"))
    };
    let late = format!("no answer within {} s", READY_WITHIN.as_secs());
    let query = state.store.read(|c| {
        diesel::sql_query("SELECT 1")
            .execute(c)
            .map_err(store::Error::from)
    });
    match tokio::time::timeout(READY_WITHIN, query).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(unavailable("the database does not answer", &e)),
        Err(_) => return Err(unavailable("the database does not answer", &late)),
    }
    let commit = state.store.check_writers();
    match tokio::time::timeout(READY_WITHIN, commit).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(unavailable("the writer cannot commit", &e)),
        Err(_) => return Err(unavailable("the writer cannot commit", &late)),
    }
    let mut checks = vec!["database".to_owned(), "writer".to_owned()];
    if let Some(bus) = &state.bus {
        if !bus.is_connected() {
            return Err(unavailable(
                "the connection to the other nodes is down",
                &"reconnecting",
            ));
        }
        checks.push("notifications".to_owned());
    }
    Ok(Json(Ready { ok: true, checks }))
}

pub async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

/// A model text checked against the configuration.
fn model(state: &AppState, text: &str) -> Result<ModelRef> {
    let model: ModelRef = text
        .parse()
        .map_err(|e: keel_schema::types::ParseModelRefError| {
            ApiError::bad_request(e.to_string())
        })?;
    if !state.config.provider.contains_key(&model.provider) {
        return Err(ApiError::new(
            ErrorType::Unprocessable,
            format!("no provider `{}` is configured", model.provider),
        ));
    }
    Ok(model)
}

/// The agent named `name`, or a 422.
fn agent(state: &AppState, name: &str) -> Result<runner::Agent> {
    state.runner.agent(name).ok_or_else(|| {
        ApiError::new(
            ErrorType::Unprocessable,
            format!("no agent `{name}` is configured"),
        )
    })
}

/// `requested` as a session directory: an existing directory inside `root` (symlinks
/// followed), as given.
fn session_directory(root: &std::path::Path, requested: &str) -> Result<String> {
    let real = std::fs::canonicalize(requested)
        .ok()
        .filter(|real| real.is_dir())
        .ok_or_else(|| {
            ApiError::bad_request(format!("the directory {requested} does not exist"))
        })?;
    if !real.starts_with(root) {
        return Err(ApiError::bad_request(format!(
            "the directory {requested} is outside {}, the root sessions are allowed in \
             (keel serve --root)",
            root.display()
        )));
    }
    Ok(requested.to_owned())
}

pub async fn create_session(
    State(state): State<AppState>,
    body: std::result::Result<Body<CreateSession>, ApiError>,
) -> Result<(StatusCode, Json<Session>)> {
    let Body(body) = body?;
    let directory = match body.directory {
        Some(directory) => session_directory(&state.root, &directory)?,
        None => state.root.to_string_lossy().into_owned(),
    };
    let name = body.agent.unwrap_or_else(|| "build".to_owned());
    let chosen = agent(&state, &name)?;
    let model = match (body.model, chosen.model) {
        (Some(text), _) => model(&state, &text)?,
        (None, Some(model)) => model,
        (None, None) => model(&state, &state.config.default_model)?,
    };
    let agent = name;
    let id = SessionId::new();
    let written = state
        .store
        .append(
            id,
            vec![DurableEvent::Created(payload::Created {
                title: body.title,
                directory,
                agent,
                model,
                metadata: None,
            })],
        )
        .await?;
    state.runner.publish(&written);
    Ok((StatusCode::CREATED, Json(existing(&state, id).await?)))
}

pub async fn list_sessions(
    State(state): State<AppState>,
    query: std::result::Result<Query<ListSessionsQuery>, QueryRejection>,
) -> Result<Json<SessionList>> {
    let Query(query) = query?;
    let limit = query.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::bad_request("limit must be between 1 and 200"));
    }
    let cursor = query
        .cursor
        .map(|c| c.parse::<SessionId>())
        .transpose()
        .map_err(|e| ApiError::bad_request(format!("cursor: {e}")))?;
    let mut items = state
        .store
        .read(move |c| view::sessions(c, cursor, limit + 1))
        .await?;
    let next_cursor = if items.len() > limit as usize {
        items.truncate(limit as usize);
        items.last().map(|s| s.id.to_string())
    } else {
        None
    };
    Ok(Json(SessionList { items, next_cursor }))
}

pub async fn get_session(ExistingSession(session): ExistingSession) -> Json<Session> {
    Json(session)
}

pub async fn update_session(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
    body: std::result::Result<Body<UpdateSession>, ApiError>,
) -> Result<Json<Session>> {
    let id = session.id;
    let Body(body) = body?;
    let mut events = Vec::new();
    if let Some(title) = body.title {
        events.push(DurableEvent::Renamed(payload::Renamed { title }));
    }
    let mut switched_to = None;
    if let Some(name) = body.agent {
        switched_to = agent(&state, &name)?.model;
        events.push(DurableEvent::AgentSwitched(payload::AgentSwitched {
            agent: name,
        }));
    }
    let model = match body.model {
        Some(text) => Some(model(&state, &text)?),
        None => switched_to.filter(|m| *m != session.model),
    };
    if let Some(model) = model {
        events.push(DurableEvent::ModelSwitched(payload::ModelSwitched {
            model,
        }));
    }
    let written = state.store.append(id, events).await?;
    state.runner.publish(&written);
    Ok(Json(existing(&state, id).await?))
}

pub async fn delete_session(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
) -> Result<StatusCode> {
    let id = session.id;
    let claimed = state.store.read(move |c| claim_holder(c, id)).await?;
    if state.runner.is_busy(id) || claimed.is_some() {
        return Err(ApiError::new(
            ErrorType::Conflict,
            "the session is running; interrupt it before deleting it",
        ));
    }
    let written = state
        .store
        .append(id, vec![DurableEvent::Deleted(payload::Deleted {})])
        .await?;
    state.runner.publish(&written);
    Ok(StatusCode::NO_CONTENT)
}

pub async fn session_status(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
) -> Result<Json<SessionStatus>> {
    status(&state, session.id).await.map(Json)
}

/// Whether the session is busy, with its claim, and how many inputs and requests wait.
async fn status(state: &AppState, id: SessionId) -> Result<SessionStatus> {
    let (claim, pending, awaiting, spent) = state
        .store
        .read(move |c| {
            Ok::<_, store::Error>((
                execution::get(c, id)?,
                view::pending_inputs(c, id)?,
                request::awaiting_replies(c, id)?,
                view::session(c, id)?.map(|s| (s.usage, s.cost)),
            ))
        })
        .await?;
    let (usage, cost) = spent.unwrap_or_default();
    Ok(SessionStatus {
        busy: claim.is_some(),
        execution: claim.map(|row| ExecutionStatus {
            id: row.claim.id,
            owner_id: row.claim.owner_id,
            phase: row.phase,
            expires_at: row.expires_at,
            recovery_error: row.recovery_error,
        }),
        pending_inputs: pending,
        awaiting_replies: awaiting,
        usage,
        cost,
    })
}

/// Admits an input, publishes what was written, and wakes the session when asked.
async fn admit(state: &AppState, id: SessionId, admission: Admission) -> Result<Admitted> {
    let clock = state.store.clock().clone();
    let delivery = admission.delivery;
    let admitted = state
        .store
        .write_for(id, move |c| {
            let admitted = inbox::admit(c, clock.now_ms(), id, admission.clone())?;
            let written: Vec<Envelope> = if admitted.replayed {
                Vec::new()
            } else {
                log::read(c, id, admitted.input.admitted_seq - 1, 2)?
            };
            Ok::<_, inbox::Error>((admitted, written))
        })
        .await;
    let (admitted, written) = admitted?;
    state.runner.publish(&written);
    if admitted.wake {
        let scope = match delivery {
            Delivery::Steer => Scope::Steer,
            Delivery::Queue => Scope::Input,
        };
        state.runner.wake(id, scope);
    }
    Ok(admitted)
}

pub async fn prompt(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
    headers: HeaderMap,
    body: std::result::Result<Body<PromptRequest>, ApiError>,
) -> Result<(StatusCode, Json<PromptResponse>)> {
    let Body(body) = body?;
    let key = idempotency_key(&headers, body.id)?;
    let id = key
        .map(|key| inbox::keyed_id(session.id, &key))
        .transpose()?;
    let admitted = admit(
        &state,
        session.id,
        Admission {
            id,
            kind: InputKind::Prompt,
            parts: body.parts,
            delivery: body.delivery.unwrap_or_default(),
            source: InputSource::User,
            request_execution: body.request_execution.unwrap_or(true),
        },
    )
    .await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(PromptResponse {
            input: admitted.input,
            replayed: admitted.replayed,
        }),
    ))
}

/// The prompt's idempotency key: the body's `id` or the standard `Idempotency-Key`
/// header (both only when they agree).
fn idempotency_key(headers: &HeaderMap, body: Option<String>) -> Result<Option<String>> {
    let header = match headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(value) => Some(value.to_str().map(str::to_owned).map_err(|_| {
            ApiError::new(
                ErrorType::Unprocessable,
                "the Idempotency-Key header must be visible ASCII",
            )
        })?),
    };
    match (header, body) {
        (Some(header), Some(body)) if header != body => Err(ApiError::new(
            ErrorType::Unprocessable,
            "the Idempotency-Key header and the body's `id` differ; send one of them",
        )),
        (header, body) => Ok(header.or(body)),
    }
}

/// The standard header naming a request's idempotency key.
const IDEMPOTENCY_KEY: &str = "idempotency-key";

pub async fn compact(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
) -> Result<(StatusCode, Json<PromptResponse>)> {
    let admitted = admit(
        &state,
        session.id,
        Admission {
            id: None,
            kind: InputKind::Compact,
            parts: Vec::new(),
            delivery: Delivery::Queue,
            source: InputSource::User,
            request_execution: true,
        },
    )
    .await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(PromptResponse {
            input: admitted.input,
            replayed: admitted.replayed,
        }),
    ))
}

pub async fn interrupt(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
) -> Result<Json<InterruptResponse>> {
    let id = session.id;
    if state.runner.interrupt(id).await {
        return Ok(Json(InterruptResponse { interrupted: true }));
    }
    // Another node (or a process gone) may hold the claim: the interrupt is recorded on it
    // before the answer, then sent to its owner.
    let interrupted = state.runner.interrupt_elsewhere(id).await?;
    Ok(Json(InterruptResponse { interrupted }))
}

pub async fn resume(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
) -> Result<(StatusCode, Json<SessionStatus>)> {
    let id = session.id;
    let runner = state.runner.clone();
    // Durable before the answer, so a resume lost with this process is still carried out.
    runner.record_resume(id).await?;
    tokio::spawn(async move {
        if let Err(e) = runner.run(id).await {
            tracing::warn!(session = %id, error = %e, "resumed execution ended with an error");
        }
    });
    Ok((StatusCode::ACCEPTED, Json(status(&state, id).await?)))
}

/// The owner of the session's claim, whichever node it is.
fn claim_holder(
    c: &mut store::Conn,
    id: SessionId,
) -> std::result::Result<Option<OwnerId>, store::Error> {
    Ok(execution::get(c, id)?.map(|row| row.claim.owner_id))
}

pub async fn reply_permission(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
    RequestPath(request): RequestPath,
    body: std::result::Result<Body<PermissionReply>, ApiError>,
) -> Result<Json<Accepted>> {
    let Body(body) = body?;
    replied(
        &state,
        session.id,
        request,
        Reply::Permission(body.decision),
    )
    .await
}

pub async fn reply_question(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
    RequestPath(request): RequestPath,
    body: std::result::Result<Body<QuestionReply>, ApiError>,
) -> Result<Json<Accepted>> {
    let Body(body) = body?;
    let reply = match body {
        QuestionReply::Answer { answer } => Reply::Answer(answer),
        QuestionReply::Dismiss { dismiss: true } => Reply::Dismiss,
        QuestionReply::Dismiss { dismiss: false } => {
            return Err(ApiError::new(
                ErrorType::Unprocessable,
                "send {\"answer\": …} or {\"dismiss\": true}",
            ));
        }
    };
    replied(&state, session.id, request, reply).await
}

/// Commits the reply (answering only once it is durable) and wakes the session, which
/// resumes its waiting step on whichever node claims it.
async fn replied(
    state: &AppState,
    session: SessionId,
    request: RequestId,
    reply: Reply,
) -> Result<Json<Accepted>> {
    state.runner.reply(session, request, reply).await?;
    Ok(Json(Accepted { accepted: true }))
}

pub async fn messages(
    State(state): State<AppState>,
    ExistingSession(session): ExistingSession,
) -> Result<Json<MessageList>> {
    let id = session.id;
    let items = state.store.read(move |c| view::messages(c, id)).await?;
    Ok(Json(MessageList { items }))
}

pub async fn agents(State(state): State<AppState>) -> Json<AgentList> {
    let items = state
        .runner
        .agents()
        .into_iter()
        .map(|(name, agent, tools)| AgentInfo {
            name,
            model: agent.model,
            tools,
            max_steps: agent.max_steps,
            temperature: agent.temperature,
        })
        .collect();
    Json(AgentList { items })
}

pub async fn mcp_servers(State(state): State<AppState>) -> Json<McpServerList> {
    use crate::mcp::State as Life;
    let items = state
        .runner
        .mcp()
        .statuses()
        .into_iter()
        .map(|status| {
            let (state, error) = match status.state {
                Life::Idle => (McpState::Idle, None),
                Life::Starting => (McpState::Starting, None),
                Life::Ready => (McpState::Ready, None),
                Life::Failed(reason) => (McpState::Failed, Some(reason)),
            };
            McpServer {
                name: status.name,
                transport: status.transport.into(),
                state,
                error,
                tools: status
                    .tools
                    .into_iter()
                    .map(|(name, effect)| McpTool { name, effect })
                    .collect(),
            }
        })
        .collect();
    Json(McpServerList { items })
}

/// `GET /metrics`: the process's metrics in the Prometheus text format, with the shared
/// gauges read from the database now.
pub async fn metrics(State(state): State<AppState>) -> Result<impl IntoResponse> {
    use crate::store::schema::{session_count, session_execution, session_request};
    use diesel::prelude::*;
    let alive_since = state.store.clock().now_ms() - 3 * state.lease_ms;
    let shared = state
        .store
        .read(move |c| {
            // Kept by the projector: counting the sessions would read every one of them
            // at every scrape.
            let sessions: i64 = session_count::table
                .select(session_count::live)
                .get_direct(c)?;
            let busy: i64 = session_execution::table.count().get_direct(c)?;
            let waiting: i64 = session_request::table
                .filter(session_request::state.eq("pending"))
                .select(diesel::dsl::count(session_request::session_id).aggregate_distinct())
                .get_direct(c)?;
            let nodes = cluster::list(c, alive_since)?.len() as u64;
            let count = |n: i64| u64::try_from(n).unwrap_or(0);
            Ok::<_, store::Error>(crate::metrics::Shared {
                idle: count(sessions - busy - waiting),
                busy: count(busy),
                waiting: count(waiting),
                nodes,
            })
        })
        .await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        crate::metrics::render(shared),
    ))
}

pub async fn nodes(State(state): State<AppState>) -> Result<Json<NodeList>> {
    let alive_since = state.store.clock().now_ms() - 3 * state.lease_ms;
    let items = state
        .store
        .read(move |c| cluster::list(c, alive_since))
        .await?;
    Ok(Json(NodeList { items }))
}

pub async fn openapi() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        include_str!("../../../contracts/openapi.json"),
    )
}
