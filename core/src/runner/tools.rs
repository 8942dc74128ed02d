//! A step's local calls: permission policies, questions, starting tools, and recording
//! how each call ended. Every write goes through the fence; a tool starts only while this
//! process owns the execution. These are methods of [`Step`], whose set of running calls
//! and cancellation they extend.

use std::collections::HashMap;
use std::sync::Arc;

use keel_schema::event::{DurableEvent, EphemeralEvent, payload};
use keel_schema::id::{CallId, RequestId};
use keel_schema::types::{Decision, ErrorInfo, InterruptReason, ToolContent};
use serde_json::{Value, json};

use super::fence::Held;
use super::step::Step;
use super::translate::Launch;
use super::{Engine, Error, Live, Policy, Reply};
use crate::provider::ToolSpec;
use crate::tool;

/// What the built-in `question` tool takes.
pub(super) const QUESTION: &str = "question";

/// The tools as the model sees them: the registry's and the question. Built once per
/// runner and shared by every request (a schema takes a while to generate).
pub(super) fn tool_specs(tools: &tool::Registry) -> Arc<[ToolSpec]> {
    tools
        .iter()
        .map(|t| ToolSpec {
            name: t.name().into(),
            description: t.description().into(),
            input_schema: t.input_schema(),
        })
        .chain(std::iter::once(question_spec()))
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

/// How a local call ended (or what it waits for next).
pub(super) enum Done {
    Ran(Result<tool::Output, tool::Error>),
    Decided(Decision, Launch),
    Answered(RequestId, String),
    Dismissed(RequestId),
    /// The wait for a reply was interrupted.
    Abandoned,
}

/// The durable result of a local call that ran: `tool.success` or `tool.failed`.
pub(super) fn result_event(
    call_id: CallId,
    result: Result<tool::Output, tool::Error>,
) -> DurableEvent {
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
            let request = RequestId::new();
            let reply = engine.wait_for(request);
            engine
                .commit(
                    held,
                    vec![DurableEvent::QuestionAsked(payload::QuestionAsked {
                        request_id: request,
                        call_id,
                        question,
                        options,
                    })],
                )
                .await?;
            let cancel = self.calls_cancel.clone();
            self.calls.spawn(async move {
                let done = tokio::select! {
                    () = cancel.cancelled() => Done::Abandoned,
                    reply = reply => match reply {
                        Ok(Reply::Answer(text)) => Done::Answered(request, text),
                        Ok(Reply::Dismiss) => Done::Dismissed(request),
                        Ok(Reply::Permission(_)) | Err(_) => Done::Abandoned,
                    },
                };
                (call_id, done)
            });
            return Ok(());
        }
        let policy = self
            .agent
            .permissions
            .get(&launch.name)
            .copied()
            .unwrap_or_default();
        let policy = if policy == Policy::Ask && engine.always_allowed(held, &launch.name).await? {
            Policy::Allow
        } else {
            policy
        };
        match policy {
            Policy::Deny => {
                engine
                    .commit(
                        held,
                        vec![DurableEvent::ToolFailed(payload::ToolFailed {
                            call_id,
                            error: ErrorInfo::new(
                                "tool.permission-denied",
                                format!("the `{}` tool is not allowed for this agent", launch.name),
                            ),
                        })],
                    )
                    .await?;
            }
            Policy::Ask => {
                let pattern = engine
                    .settings
                    .tools
                    .get(&launch.name)
                    .map(|t| t.permission_pattern(&launch.input))
                    .unwrap_or_default();
                let request = RequestId::new();
                let reply = engine.wait_for(request);
                engine
                    .commit(
                        held,
                        vec![DurableEvent::PermissionRequested(
                            payload::PermissionRequested {
                                request_id: request,
                                call_id,
                                tool: launch.name.clone(),
                                pattern,
                            },
                        )],
                    )
                    .await?;
                let cancel = self.calls_cancel.clone();
                self.calls.spawn(async move {
                    let done = tokio::select! {
                        () = cancel.cancelled() => Done::Abandoned,
                        reply = reply => match reply {
                            Ok(Reply::Permission(decision)) => Done::Decided(decision, launch),
                            Ok(Reply::Answer(_) | Reply::Dismiss) | Err(_) => Done::Abandoned,
                        },
                    };
                    (call_id, done)
                });
            }
            Policy::Allow => self.start_tool(launch)?,
        }
        Ok(())
    }

    /// Starts a tool run, after checking ownership one last time.
    fn start_tool(&mut self, launch: Launch) -> Result<(), Error> {
        let (engine, held) = (self.engine, self.held);
        if !engine.owns(held) {
            return Err(Error::OwnershipLost(held.claim.session_id));
        }
        let call_id = launch.call_id;
        let Some(tool) = engine.settings.tools.get(&launch.name).cloned() else {
            self.calls.spawn(async move {
                (
                    call_id,
                    Done::Ran(Err(tool::Error::InvalidInput(format!(
                        "no tool `{}`",
                        launch.name
                    )))),
                )
            });
            return Ok(());
        };
        let directory = match &self.directory {
            Ok(directory) => directory.clone(),
            Err(message) => {
                let message = message.clone();
                self.calls
                    .spawn(async move { (call_id, Done::Ran(Err(tool::Error::Io(message)))) });
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
        self.calls.spawn(async move {
            let result = tool.run(launch.input, &context).await;
            (call_id, Done::Ran(result))
        });
        Ok(())
    }

    /// Records how a local call ended, or starts it once permitted. Returns a reason when
    /// the reply interrupts the continuation.
    pub(super) async fn settle_call(
        &mut self,
        call_id: CallId,
        done: Done,
    ) -> Result<Option<InterruptReason>, Error> {
        let (engine, held) = (self.engine, self.held);
        match done {
            // Left unresolved: the step's `step.interrupted` fails it durably.
            Done::Abandoned => Ok(None),
            Done::Ran(Err(tool::Error::Interrupted)) if self.is_interrupted() => Ok(None),
            Done::Ran(result) => {
                engine
                    .commit(held, vec![result_event(call_id, result)])
                    .await?;
                Ok(None)
            }
            Done::Decided(decision, launch) => {
                let request = engine.request_of(held, call_id).await?;
                let mut events = vec![DurableEvent::PermissionReplied(
                    payload::PermissionReplied {
                        request_id: request,
                        decision,
                    },
                )];
                if decision == Decision::Reject {
                    events.push(DurableEvent::ToolFailed(payload::ToolFailed {
                        call_id,
                        error: ErrorInfo::new(
                            "tool.permission-rejected",
                            format!("the user rejected this `{}` call", launch.name),
                        ),
                    }));
                    engine.commit(held, events).await?;
                    return Ok(Some(InterruptReason::PermissionRejected));
                }
                engine.commit(held, events).await?;
                self.start_tool(launch)?;
                Ok(None)
            }
            Done::Answered(request, answer) => {
                engine
                    .commit(
                        held,
                        vec![
                            DurableEvent::QuestionAnswered(payload::QuestionAnswered {
                                request_id: request,
                                answer: answer.clone(),
                            }),
                            DurableEvent::ToolSuccess(payload::ToolSuccess {
                                call_id,
                                structured: json!({"answer": answer}),
                                content: vec![ToolContent::Text { text: answer }],
                                result: None,
                            }),
                        ],
                    )
                    .await?;
                Ok(None)
            }
            Done::Dismissed(request) => {
                engine
                    .commit(
                        held,
                        vec![
                            DurableEvent::QuestionDismissed(payload::QuestionDismissed {
                                request_id: request,
                            }),
                            DurableEvent::ToolFailed(payload::ToolFailed {
                                call_id,
                                error: ErrorInfo::new(
                                    "tool.question-dismissed",
                                    "the user dismissed the question",
                                ),
                            }),
                        ],
                    )
                    .await?;
                Ok(Some(InterruptReason::QuestionDismissed))
            }
        }
    }
}

impl Engine {
    /// The permission request made for `call_id` in this session.
    async fn request_of(&self, held: &Held, call_id: CallId) -> Result<RequestId, Error> {
        let session = held.claim.session_id;
        let log = self.store.read_log(session, 0, u32::MAX).await?;
        log.iter()
            .rev()
            .find_map(|e| match &e.event {
                DurableEvent::PermissionRequested(p) if p.call_id == call_id => Some(p.request_id),
                _ => None,
            })
            .ok_or_else(|| {
                crate::store::Error::Corrupt(format!("no permission request for {call_id}")).into()
            })
    }

    /// Whether an earlier `always` reply allows `tool` for the rest of the session.
    async fn always_allowed(&self, held: &Held, tool: &str) -> Result<bool, Error> {
        let session = held.claim.session_id;
        let log = self.store.read_log(session, 0, u32::MAX).await?;
        let mut tools: HashMap<RequestId, String> = HashMap::new();
        for event in &log {
            match &event.event {
                DurableEvent::PermissionRequested(p) => {
                    tools.insert(p.request_id, p.tool.clone());
                }
                DurableEvent::PermissionReplied(r)
                    if r.decision == Decision::Always
                        && tools.get(&r.request_id).is_some_and(|t| t == tool) =>
                {
                    return Ok(true);
                }
                _ => {}
            }
        }
        Ok(false)
    }
}
