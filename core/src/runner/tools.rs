//! A step's local calls: permission policies, questions, starting tools, recording how
//! each call ended, and acting on the replies a resumed step finds. Every write goes
//! through the fence; a tool starts only while this process owns the execution. These are
//! methods of [`Step`], whose set of running calls and cancellation they extend.
//!
//! A call that needs a person (policy `ask`, or the `question` tool) commits its request
//! and joins the step's `awaiting` calls; nothing waits for the reply in memory. The step
//! ends its response with `step.awaiting` when those are all that is left, and resumes
//! from the log once replies commit ([`crate::request`]).

use std::sync::Arc;

use keel_schema::event::{DurableEvent, EphemeralEvent, payload};
use keel_schema::id::{CallId, RequestId};
use keel_schema::types::{Decision, ErrorInfo, InterruptReason, Phase, ToolContent};
use serde_json::{Value, json};

use super::fence::Held;
use super::step::Step;
use super::translate::Launch;
use super::{Agent, Engine, Error, Live, Policy};
use crate::execution;
use crate::provider::ToolSpec;
use crate::request::{self, Reply};
use crate::tool;

/// What the built-in `question` tool takes.
pub(super) const QUESTION: &str = "question";

/// The tools as the model sees them: the registry's and the question, as many as
/// `agent` offers. Built once per agent and runner and shared by every request (a schema
/// takes a while to generate).
pub(super) fn tool_specs(tools: &tool::Registry, agent: &Agent) -> Arc<[ToolSpec]> {
    tools
        .iter()
        .map(|t| ToolSpec {
            name: t.name().into(),
            description: t.description().into(),
            input_schema: t.input_schema(),
        })
        .chain(std::iter::once(question_spec()))
        .filter(|spec| agent.offers(&spec.name))
        .collect()
}

fn question_spec() -> ToolSpec {
    ToolSpec {
        name: QUESTION.into(),
        description: "Ask the user a question and wait for the answer.".into(),
        input_schema: json!({
            "type": "object",
            "properties": {
                "question": {"type": "string"},
                "options": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["question"],
            "additionalProperties": false,
        }),
    }
}

/// How a local call that ran ended.
pub(super) type Ran = Result<tool::Output, tool::Error>;

/// The durable result of a local call that ran: `tool.success` or `tool.failed`.
pub(super) fn result_event(call_id: CallId, result: Ran) -> DurableEvent {
    match result {
        Ok(output) => DurableEvent::ToolSuccess(payload::ToolSuccess {
            call_id,
            structured: output.structured,
            content: output.content,
            result: None,
        }),
        Err(error) => DurableEvent::ToolFailed(payload::ToolFailed {
            call_id,
            error: error.info(),
        }),
    }
}

impl Step<'_> {
    /// Acts on a local call whose `tool.called` has committed: asks, denies, or starts it.
    pub(super) async fn launch(&mut self, launch: Launch) -> Result<(), Error> {
        let (engine, held) = (self.engine, self.held);
        if !engine.owns(held) {
            return Err(Error::OwnershipLost(held.claim.session_id));
        }
        let call_id = launch.call_id;
        if launch.name == QUESTION {
            let question = launch.input["question"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let options: Vec<String> = launch.input["options"]
                .as_array()
                .map(|o| {
                    o.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            engine
                .commit(
                    held,
                    vec![DurableEvent::QuestionAsked(payload::QuestionAsked {
                        request_id: RequestId::new(),
                        call_id,
                        question,
                        options,
                    })],
                )
                .await?;
            self.awaiting.push(call_id);
            return Ok(());
        }
        let Some(tool) = engine.tool(&launch.name) else {
            // Fails as an unknown tool, asking nobody.
            return self.start_tool(launch);
        };
        let verdict = if self.agent.offers(&launch.name) {
            let root = self
                .directory
                .as_deref()
                .unwrap_or(std::path::Path::new(""));
            let pattern = tool.permission_pattern(&launch.input, root);
            let verdict = self
                .agent
                .permissions
                .decide(&launch.name, tool.effect(), &pattern);
            Some((verdict, pattern))
        } else {
            None
        };
        let policy = match &verdict {
            None => Policy::Deny,
            Some((verdict, pattern))
                if verdict.policy == Policy::Ask
                    && engine
                        .always_allowed(held, launch.name.clone(), pattern.clone())
                        .await? =>
            {
                Policy::Allow
            }
            Some((verdict, _)) => verdict.policy,
        };
        match policy {
            Policy::Deny => {
                let message = if verdict.is_some() {
                    format!(
                        "the agent's permission rules refuse this `{}` call",
                        launch.name
                    )
                } else {
                    format!("this agent does not offer the `{}` tool", launch.name)
                };
                engine
                    .commit(
                        held,
                        vec![DurableEvent::ToolFailed(payload::ToolFailed {
                            call_id,
                            error: ErrorInfo::new("tool.permission-denied", message),
                        })],
                    )
                    .await?;
            }
            Policy::Ask => {
                let (verdict, pattern) = verdict.expect("asks come from a verdict");
                engine
                    .commit(
                        held,
                        vec![DurableEvent::PermissionRequested(
                            payload::PermissionRequested {
                                request_id: RequestId::new(),
                                call_id,
                                tool: launch.name.clone(),
                                pattern,
                                rule: verdict.rule,
                            },
                        )],
                    )
                    .await?;
                self.awaiting.push(call_id);
            }
            Policy::Allow => self.start_tool(launch)?,
        }
        Ok(())
    }

    /// Starts a tool run, after checking ownership one last time.
    pub(super) fn start_tool(&mut self, launch: Launch) -> Result<(), Error> {
        let (engine, held) = (self.engine, self.held);
        if !engine.owns(held) {
            return Err(Error::OwnershipLost(held.claim.session_id));
        }
        let call_id = launch.call_id;
        let Some(tool) = engine.tool(&launch.name) else {
            self.calls.spawn(async move {
                (
                    call_id,
                    Err(tool::Error::InvalidInput(format!(
                        "no tool `{}`",
                        launch.name
                    ))),
                )
            });
            return Ok(());
        };
        let directory = match &self.directory {
            Ok(directory) => directory.clone(),
            Err(message) => {
                let message = message.clone();
                self.calls
                    .spawn(async move { (call_id, Err(tool::Error::Io(message))) });
                return Ok(());
            }
        };
        let (progress_tx, mut progress_rx) = tokio::sync::mpsc::channel::<Value>(64);
        let context = tool::Context {
            directory,
            cancel: self.calls_cancel.clone(),
            limits: engine.settings.limits,
            progress: Some(progress_tx),
            call: Some((held.claim.session_id, call_id)),
            sandbox: tool::sandbox::Sandbox::for_mode(
                self.agent.sandbox,
                &engine.settings.protected,
            ),
        };
        let live = engine.live.clone();
        let session = held.claim.session_id;
        let ownership = held.ownership.clone();
        let clock = engine.store.clock().clone();
        // Progress is published only while the claim is this process's, like every delta.
        tokio::spawn(async move {
            while let Some(metadata) = progress_rx.recv().await {
                if ownership.holds(clock.now_ms()) {
                    live.publish(Live::Ephemeral(keel_schema::event::EphemeralEnvelope {
                        session_id: session,
                        time: clock.now_ms(),
                        event: EphemeralEvent::ToolProgress(payload::ToolProgress {
                            call_id,
                            metadata,
                        }),
                    }));
                }
            }
        });
        let span = tracing::info_span!("tool", tool = %launch.name, call = %call_id);
        self.calls.spawn(tracing::Instrument::instrument(
            async move {
                let began = std::time::Instant::now();
                let result = tool.run(launch.input, &context).await;
                let outcome = match &result {
                    Ok(_) => "ok".to_owned(),
                    Err(error) => error.info().kind,
                };
                let elapsed = began.elapsed();
                crate::metrics::tool_ran(tool.name(), &outcome, elapsed);
                tracing::debug!(%outcome, ms = elapsed.as_millis() as u64, "tool call ended");
                (call_id, result)
            },
            span,
        ));
        Ok(())
    }

    /// Records how a local call that ran ended. A call the step's interrupt stopped is
    /// left unresolved: the step's `step.interrupted` fails it durably.
    pub(super) async fn settle_call(&mut self, call_id: CallId, result: Ran) -> Result<(), Error> {
        if matches!(result, Err(tool::Error::Interrupted)) && self.is_interrupted() {
            return Ok(());
        }
        // After the output read before it.
        self.flush().await?;
        self.engine
            .commit(self.held, vec![result_event(call_id, result)])
            .await?;
        Ok(())
    }

    /// Acts on the replies a resumed step found: a permitted call starts, a refused one
    /// fails and stops the continuation, an answered question succeeds with the answer, a
    /// dismissed one fails and stops the continuation. Calls still unanswered (unless an
    /// `always` since covers them) keep waiting. Every result, and the claim's move to
    /// the step, commit in one fenced write before any tool starts.
    pub(super) async fn act_on_replies(
        &mut self,
        waiting: Vec<(request::Open, Launch)>,
    ) -> Result<(), Error> {
        let (engine, held) = (self.engine, self.held);
        let mut events = Vec::new();
        let mut start = Vec::new();
        for (open, launch) in waiting {
            let call_id = launch.call_id;
            match open.reply {
                Some(Reply::Permission(Decision::Once | Decision::Always)) => start.push(launch),
                Some(Reply::Permission(Decision::Reject)) => {
                    events.push(DurableEvent::ToolFailed(payload::ToolFailed {
                        call_id,
                        error: ErrorInfo::new(
                            "tool.permission-rejected",
                            format!("the user rejected this `{}` call", launch.name),
                        ),
                    }));
                    self.stopped
                        .get_or_insert(InterruptReason::PermissionRejected);
                }
                Some(Reply::Answer(answer)) => {
                    events.push(DurableEvent::ToolSuccess(payload::ToolSuccess {
                        call_id,
                        structured: json!({"answer": answer}),
                        content: vec![ToolContent::Text { text: answer }],
                        result: None,
                    }));
                }
                Some(Reply::Dismiss) => {
                    events.push(DurableEvent::ToolFailed(payload::ToolFailed {
                        call_id,
                        error: ErrorInfo::new(
                            "tool.question-dismissed",
                            "the user dismissed the question",
                        ),
                    }));
                    self.stopped
                        .get_or_insert(InterruptReason::QuestionDismissed);
                }
                None if open.kind == request::Kind::Permission
                    && engine
                        .always_allowed(held, open.tool.clone(), open.pattern.clone())
                        .await? =>
                {
                    start.push(launch);
                }
                None => self.awaiting.push(call_id),
            }
        }
        let (claim, step) = (held.claim, self.open_step());
        let envelopes = engine
            .fenced(held, move |c, now| {
                execution::set_phase(c, &claim, Phase::Running, Some(step))?;
                crate::event::log::append(c, now, claim.session_id, events.clone())
                    .map_err(Error::from)
            })
            .await?;
        engine.publish(&envelopes);
        for launch in start {
            self.start_tool(launch)?;
        }
        Ok(())
    }
}

impl Engine {
    /// Whether an earlier `always` reply allows `tool` for the rest of the session.
    async fn always_allowed(
        &self,
        held: &Held,
        tool: String,
        pattern: String,
    ) -> Result<bool, Error> {
        let session = held.claim.session_id;
        self.store
            .read(move |c| {
                request::always_allowed(c, session, &tool, &pattern).map_err(Error::from)
            })
            .await
    }
}
