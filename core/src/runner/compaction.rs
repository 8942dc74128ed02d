//! Compaction: the provider summarises older history so the transcript fits the model.
//!
//! Three things start one:
//! - **manual**: a `compact` control input (`POST …/compact`), promoted at an idle
//!   boundary; its `compaction.started` names the input;
//! - **automatic**: before a step, when the estimated request reaches the model's context
//!   limit minus its output limit ([`needs_compaction`]); `compaction.ended` commits
//!   together with a synthetic "continue" message, the continuation it enables, so a
//!   crash after it still leaves the model a turn to answer;
//! - **overflow**: the provider refused a step's request as too long before any output;
//!   the step compacts once and sends the request again (see `step.rs`).
//!
//! The summary stands for every message before `boundary_seq`: the open step's assistant
//! message when compacting mid-step (that step goes on), else everything so far. Only
//! whole messages are summarised or kept, and a message keeps its tool calls together
//! with their results, so the transcript stays valid. The summary request carries the
//! tool definitions (some providers refuse tool calls in history without them) with
//! tool use disabled, and is not retried: a failure or an interrupt publishes
//! `compaction.failed` and leaves the history as it was.

use futures::StreamExt;
use keel_schema::api::Message;
use keel_schema::event::{DurableEvent, EphemeralEvent, payload};
use keel_schema::id::{InputId, MessageId};
use keel_schema::types::{CompactionReason, ErrorInfo, Part, Phase, SyntheticReason, Usage};
use tokio_util::sync::CancellationToken;

use super::fence::Held;
use super::{Engine, Error, context};
use crate::coordinator::BoxFuture;
use crate::provider::{self, Event, ToolChoice, Turn};
use crate::{epoch, execution};

/// The summariser's system prompt.
const SUMMARY_SYSTEM: &str = "You summarise a coding agent's session so that the agent can \
    continue it from your summary alone.";

/// The last turn of a summary request.
const SUMMARY_REQUEST: &str = "Summarise the conversation above so the work can continue \
    from the summary alone: the user's goal and requests, what was done (files read and \
    changed, commands run and their results), decisions and their reasons, open problems, \
    and the next steps. Be specific (paths, names, errors) and concise.";

/// The continuation after an automatic compaction.
pub const CONTINUE: &str = "The conversation above was summarised to fit the model's \
    context. Continue the task from the summary.";

/// A model's limits, in tokens, from `[model."provider/id"]` in `keel.toml`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLimits {
    pub context: u64,
    pub output: u64,
}

/// How a compaction ended (its events are published either way).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Compacted {
    /// The summary committed and the next context epoch began with `system`, the system
    /// prompt of the requests that follow.
    Done { system: String },
    /// The summary request failed; `compaction.failed` names why.
    Failed(provider::Error),
    /// An interrupt stopped the summary request.
    Interrupted,
}

/// Whether a request of about `estimate` tokens must be compacted first under `limits`:
/// it reaches the context limit less the room kept for the answer.
pub fn needs_compaction(estimate: u64, limits: ModelLimits) -> bool {
    let room = limits.output.min(limits.context / 2);
    estimate >= limits.context.saturating_sub(room)
}

/// A rough token count of a request: about four characters a token, over everything
/// that is sent.
pub fn estimate_tokens(request: &provider::Request) -> u64 {
    let tools: usize = request
        .tools
        .iter()
        .map(|t| t.name.len() + t.description.len() + provider::json_len(&t.input_schema))
        .sum();
    u64::try_from((request.approximate_chars() + tools) / 4).unwrap_or(u64::MAX)
}

impl Engine {
    /// Compacts the session of `held`. `open_step` is the assistant message (and its seq)
    /// of a step that goes on after the compaction; `input` the control input a manual
    /// compaction promotes.
    ///
    /// Boxed: a future is as large as the largest thing it awaits anywhere, and a
    /// compaction (a summary request, its fenced writes) is large and rare. Awaited in
    /// place, it would make every step and drain carry its size for as long as they
    /// run, streaming or waiting included.
    pub(super) fn compact<'a>(
        &'a self,
        held: &'a Held,
        reason: CompactionReason,
        input: Option<InputId>,
        open_step: Option<(MessageId, u64)>,
        cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<Compacted, Error>> {
        Box::pin(self.compact_now(held, reason, input, open_step, cancel))
    }

    async fn compact_now(
        &self,
        held: &Held,
        reason: CompactionReason,
        input: Option<InputId>,
        open_step: Option<(MessageId, u64)>,
        cancel: &CancellationToken,
    ) -> Result<Compacted, Error> {
        let session = held.claim.session_id;
        let info = self.session_info(session).await?;
        let provider = self.provider(&info.model)?;
        let claim = held.claim;
        let started = self
            .fenced(held, move |c, now| {
                let envelopes = crate::event::log::append(
                    c,
                    now,
                    session,
                    vec![DurableEvent::CompactionStarted(
                        payload::CompactionStarted {
                            reason,
                            input_id: input,
                        },
                    )],
                )?;
                execution::set_phase(c, &claim, Phase::Compacting, open_step)?;
                Ok(envelopes)
            })
            .await?;
        self.publish(&started);
        let boundary_seq = match open_step {
            Some((_, seq)) => seq,
            None => started.first().map_or(0, |e| e.seq),
        };
        let before: Vec<Message> = self
            .messages(session)
            .await?
            .into_iter()
            .filter(|m| message_seq(m) < boundary_seq)
            .collect();
        let mut turns = context::turn_list(&before);
        if turns.is_empty() {
            let error = ErrorInfo::new("compaction.empty", "there is no history to summarise");
            self.end_failed(held, open_step, error).await?;
            return Ok(Compacted::Failed(provider::Error::BadRequest(
                "there is no history to summarise".into(),
            )));
        }
        turns.push(Turn::User {
            parts: vec![Part::Text {
                text: SUMMARY_REQUEST.into(),
            }],
        });
        let request = provider::Request {
            model: info.model.clone(),
            system: SUMMARY_SYSTEM.into(),
            turns: turns.into(),
            tools: self.specs(&info.agent),
            temperature: None,
            tool_choice: ToolChoice::None,
            max_output_tokens: self.limits(&info.model).map(|l| saturate(l.output)),
        };

        let mut stream = crate::metrics::observed(&request, provider.stream(&request));
        let mut summary = String::new();
        let mut usage: Option<Usage> = None;
        let failure = loop {
            let item = tokio::select! {
                biased;
                () = cancel.cancelled() => {
                    let error = ErrorInfo::new("compaction.interrupted", "the compaction was interrupted");
                    self.end_failed(held, open_step, error).await?;
                    return Ok(Compacted::Interrupted);
                }
                item = stream.next() => item,
            };
            match item {
                Some(Ok(Event::TextDelta(text))) => {
                    self.publish_ephemeral(
                        held,
                        EphemeralEvent::CompactionDelta(payload::CompactionDelta {
                            text: text.clone(),
                        }),
                    );
                    summary.push_str(&text);
                }
                Some(Ok(Event::Finish { usage: u, .. })) => usage = Some(u),
                Some(Ok(_)) => {}
                Some(Err(e)) => break Some(e),
                None if usage.is_none() => {
                    break Some(provider::Error::Incomplete(
                        "the summary stream ended without a finish".into(),
                    ));
                }
                None => break None,
            }
        };
        let summary = summary.trim().to_owned();
        let failure = failure.or_else(|| {
            summary
                .is_empty()
                .then(|| provider::Error::Protocol("the summary was empty".into()))
        });
        if let Some(error) = failure {
            self.end_failed(held, open_step, error.info()).await?;
            return Ok(Compacted::Failed(error));
        }

        let continues = open_step.is_none() && reason != CompactionReason::Manual;
        let ended = DurableEvent::CompactionEnded(payload::CompactionEnded {
            summary,
            boundary_seq,
            usage: usage.unwrap_or_default(),
        });
        // The prompt a session without an epoch yet starts its first one with.
        let project = self.project_instructions(Some(&info.directory)).await;
        let agent_system = self
            .agent(&info.agent)
            .map(|a| crate::instructions::system_prompt(&a.system, &project.unwrap_or_default()))
            .unwrap_or_default();
        let (claim, phase) = (held.claim, phase_after(open_step));
        let (system, envelopes) = self
            .fenced(held, move |c, now| {
                // The next epoch starts with the summary, in the same transaction: both
                // or neither, and never after ownership changed.
                let (epoch, system) = epoch::advance(c, session, boundary_seq, &agent_system)?;
                let mut events = vec![ended.clone(), epoch];
                if continues {
                    events.push(DurableEvent::Synthetic(payload::Synthetic {
                        message_id: MessageId::new(),
                        text: CONTINUE.into(),
                        reason: SyntheticReason::Continue,
                    }));
                }
                let envelopes = crate::event::log::append(c, now, session, events)?;
                execution::set_phase(c, &claim, phase, open_step)?;
                Ok((system, envelopes))
            })
            .await?;
        self.publish(&envelopes);
        tracing::info!(%session, ?reason, boundary_seq, "history compacted");
        Ok(Compacted::Done { system })
    }

    async fn end_failed(
        &self,
        held: &Held,
        open_step: Option<(MessageId, u64)>,
        error: ErrorInfo,
    ) -> Result<(), Error> {
        tracing::warn!(session = %held.claim.session_id, error = %error.message, "compaction failed");
        self.end(
            held,
            open_step,
            vec![DurableEvent::CompactionFailed(payload::CompactionFailed {
                error,
            })],
        )
        .await
    }

    /// Publishes the compaction's end and puts the claim back in the phase of the work
    /// that goes on.
    async fn end(
        &self,
        held: &Held,
        open_step: Option<(MessageId, u64)>,
        events: Vec<DurableEvent>,
    ) -> Result<(), Error> {
        let session = held.claim.session_id;
        let claim = held.claim;
        let phase = phase_after(open_step);
        let envelopes = self
            .fenced(held, move |c, now| {
                let envelopes = crate::event::log::append(c, now, session, events.clone())?;
                execution::set_phase(c, &claim, phase, open_step)?;
                Ok(envelopes)
            })
            .await?;
        self.publish(&envelopes);
        Ok(())
    }

    /// The configured limits of `model`, if any.
    pub(super) fn limits(&self, model: &keel_schema::types::ModelRef) -> Option<ModelLimits> {
        self.settings.models.get(&model.to_string()).copied()
    }
}

/// The phase of the work that goes on after a compaction: the open step's, or none yet.
fn phase_after(open_step: Option<(MessageId, u64)>) -> Phase {
    if open_step.is_some() {
        Phase::Running
    } else {
        Phase::Claimed
    }
}

/// The seq of the event that created `message`.
pub(super) fn message_seq(message: &Message) -> u64 {
    match message {
        Message::User { seq, .. }
        | Message::Assistant { seq, .. }
        | Message::Synthetic { seq, .. }
        | Message::System { seq, .. }
        | Message::Summary { seq, .. } => *seq,
    }
}

fn saturate(tokens: u64) -> u32 {
    u32::try_from(tokens).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compaction_is_needed_once_the_answer_would_not_fit() {
        let limits = ModelLimits {
            context: 10_000,
            output: 2_000,
        };
        assert!(!needs_compaction(7_999, limits));
        assert!(needs_compaction(8_000, limits));
        // An output limit as large as the context keeps half of it for the answer.
        let generous = ModelLimits {
            context: 10_000,
            output: 10_000,
        };
        assert!(!needs_compaction(4_999, generous));
        assert!(needs_compaction(5_000, generous));
    }
}
