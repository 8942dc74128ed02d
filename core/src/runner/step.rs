//! One step: a provider request, its streamed response, and the local tools it called.
//!
//! The publisher turns provider events into durable and ephemeral events under these
//! rules: at most one open text and one open reasoning fragment; ordinals count per kind;
//! deltas are ephemeral; a duplicate start, call, result or finish is a protocol error
//! that fails the step. Whatever the stream has ready goes out together: its durable
//! events in one fenced write, then everything live in order ([`Outbox`]). Local tools
//! start only after their `tool.called` commits, run concurrently, and are all joined
//! before the step settles; the result of the last one is held for the step's end. A
//! hosted call left unresolved at the end of the stream fails. Each step ends in exactly
//! one of `step.ended`, `step.failed` or `step.interrupted`; a step that ended leaves
//! those closing events to the drain ([`Ended`]).
//!
//! Before any output a retryable provider failure is sent again after a backoff
//! ([`super::retry`]), and a context overflow compacts the history once and sends the
//! request again ([`super::compaction`]); after output, a failure is the step's error.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use keel_schema::api::Message;
use keel_schema::event::{DurableEvent, EphemeralEvent, payload};
use keel_schema::id::{CallId, MessageId};
use keel_schema::types::{
    CompactionReason, Effect, ErrorInfo, Finish, InterruptReason, ModelRef, Phase, Usage,
};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::compaction::{Compacted, estimate_tokens, needs_compaction};
use super::publisher::{Publisher, coalesce};
use super::tools::{Done, QUESTION, result_event};
use super::{Engine, Error, Held, context};
use crate::event::projector;
use crate::execution;
use crate::provider::{self, Provider, ToolChoice};

/// How a step ended, as far as the drain needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSummary {
    pub finish: Option<Finish>,
    /// Whether any local tool call was made (a continuation follows tool results).
    pub called_tools: bool,
    /// A rejected permission or dismissed question interrupted the continuation.
    pub stopped: bool,
}

impl StepSummary {
    /// Whether a tool-driven continuation follows.
    pub fn continues(&self) -> bool {
        !self.stopped && self.called_tools && self.finish == Some(Finish::ToolCalls)
    }
}

/// Appends `step.started` for step `number` of the claim's session and sets the claim
/// `running` with it, in the caller's fenced transaction. Returns the new assistant
/// message, the event's seq, and what was written.
pub(super) fn start_step(
    connection: &mut crate::store::Conn,
    now: i64,
    claim: &execution::Claim,
    info: &projector::SessionInfo,
    number: u32,
) -> Result<((MessageId, u64), Vec<keel_schema::event::Envelope>), Error> {
    let assistant = MessageId::new();
    let envelopes = crate::event::log::append(
        connection,
        now,
        claim.session_id,
        vec![DurableEvent::StepStarted(payload::StepStarted {
            assistant_message_id: assistant,
            step: number,
            agent: info.agent.clone(),
            model: info.model.clone(),
        })],
    )?;
    let seq = envelopes.first().map_or(0, |e| e.seq);
    execution::set_phase(connection, claim, Phase::Running, Some((assistant, seq)))?;
    Ok(((assistant, seq), envelopes))
}

/// A step that ended (`step.ended`, or `step.interrupted` after a refused permission or
/// a dismissed question) with its closing events not yet written: the drain commits them
/// in the next boundary's transaction, one write where there were two.
#[derive(Debug)]
pub struct Ended {
    pub summary: StepSummary,
    pub assistant: MessageId,
    /// The last calls' results, the closing of open fragments, and the terminal event.
    pub closing: Vec<DurableEvent>,
}

impl Engine {
    /// Runs one step of `held`'s session. `messages` is the transcript to send and `info`
    /// the session's settings, both read at the boundary before it; `started` its
    /// assistant message and `step.started` seq when the boundary wrote that event
    /// ([`start_step`]). A step that failed or was interrupted has written its end; one
    /// that ended returns it unwritten.
    pub(super) async fn step(
        &self,
        held: &Held,
        step_number: u32,
        messages: &[Message],
        info: projector::SessionInfo,
        started: Option<(MessageId, u64)>,
        cancel: &CancellationToken,
    ) -> Result<Ended, Error> {
        let session = held.claim.session_id;
        let agent = self.agent(&info.agent)?;
        let provider = self.provider(&info.model)?;
        let last_step = step_number >= agent.max_steps;
        let mut known: HashMap<String, Effect> = self
            .settings
            .tools
            .iter()
            .map(|t| (t.name().to_owned(), t.effect()))
            .collect();
        known.insert(QUESTION.into(), Effect::Read);
        let limits = self.limits(&info.model);
        let mut request = provider::Request {
            model: info.model.clone(),
            system: agent.system.clone(),
            turns: context::turns(messages),
            tools: self.specs.clone(),
            tool_choice: if last_step {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            },
            max_output_tokens: limits.map(|l| u32::try_from(l.output).unwrap_or(u32::MAX)),
        };
        // One compaction per logical step: automatic here, or forced by an overflow below.
        let mut compacted = false;
        if let Some(limits) = limits
            && needs_compaction(estimate_tokens(&request), limits)
        {
            compacted = true;
            match self
                .compact(held, CompactionReason::Auto, None, None, cancel)
                .await?
            {
                Compacted::Done => request.turns = context::turns(&self.messages(session).await?),
                Compacted::Interrupted => return Err(Error::Interrupted),
                // The step goes ahead; if the provider refuses it as too long, it fails.
                Compacted::Failed(_) => {}
            }
        }

        // The fenced `step.started` is the ownership check before the provider request;
        // the boundary has written it already when nothing had to come first.
        let (assistant, assistant_seq) = match started {
            Some(started) => started,
            None => {
                let claim = held.claim;
                let info = info.clone();
                let (started, envelopes) = self
                    .fenced(held, move |c, now| {
                        start_step(c, now, &claim, &info, step_number)
                    })
                    .await?;
                self.broadcast(&envelopes);
                started
            }
        };
        if cancel.is_cancelled() {
            return Err(Error::Interrupted);
        }
        if !self.owns(held) {
            return Err(Error::OwnershipLost(session));
        }

        let tool_cancel = cancel.child_token();
        let result: Result<Ended, Error> = async {
            let directory = std::fs::canonicalize(&info.directory).map_err(|e| {
                format!("the session directory {} is not usable: {e}", info.directory)
            });
            let mut publisher = Publisher::new(assistant, known, last_step);
            let mut tasks: JoinSet<(CallId, Done)> = JoinSet::new();
            let mut stream = provider.stream(&request);
            let mut stream_open = true;
            // Whether the provider said anything yet: after that, no transparent retry.
            let mut output_started = false;
            let mut retries = 0u32;
            let mut interrupted = false;
            let mut failure: Option<provider::Error> = None;
            let mut stop: Option<InterruptReason> = None;
            let mut called_tools = false;
            let mut outbox = Outbox::default();
            // Results of the calls that finished last, held for the step's closing write.
            let mut last_results: Vec<DurableEvent> = Vec::new();

            loop {
                if !stream_open && tasks.is_empty() {
                    break;
                }
                tokio::select! {
                    biased;
                    () = cancel.cancelled(), if !interrupted => {
                        interrupted = true;
                        stream_open = false;
                        tool_cancel.cancel();
                    }
                    Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                        let (call_id, done) = joined.map_err(|e| Error::ToolTask(Arc::new(e)))?;
                        match done {
                            // The step's last word: the result commits with the step's end.
                            Done::Ran(result) if !stream_open && tasks.is_empty() && !interrupted => {
                                last_results.push(result_event(call_id, result));
                            }
                            done => {
                                if let Some(reason) = self
                                    .settle_call(held, directory.as_ref().ok(), call_id, done, &tool_cancel, &mut tasks, interrupted)
                                    .await?
                                {
                                    stop.get_or_insert(reason);
                                }
                            }
                        }
                    }
                    item = stream.next(), if stream_open => {
                        let mut item = item;
                        let mut retry: Option<(provider::Error, Duration)> = None;
                        let mut overflow: Option<provider::Error> = None;
                        // Take everything the stream has ready, so deltas go out batched.
                        loop {
                            match item {
                                None if !output_started => {
                                    // Ended before saying anything: cut short, retried like one.
                                    let e = provider::Error::Incomplete(
                                        "the stream ended before any output".into(),
                                    );
                                    match self.retry_or_fail(e, retries, output_started) {
                                        Ok(next) => retry = Some(next),
                                        Err(e) => failure = Some(e),
                                    }
                                    stream_open = false;
                                    break;
                                }
                                None => {
                                    stream_open = false;
                                    break;
                                }
                                Some(Err(e @ provider::Error::ContextOverflow(_)))
                                    if !output_started && !compacted =>
                                {
                                    overflow = Some(e);
                                    stream_open = false;
                                    break;
                                }
                                Some(Err(e)) => {
                                    match self.retry_or_fail(e, retries, output_started) {
                                        Ok(next) => retry = Some(next),
                                        Err(e) => failure = Some(e),
                                    }
                                    stream_open = false;
                                    break;
                                }
                                Some(Ok(event)) => match publisher.accept(event) {
                                    Err(e) => {
                                        failure = Some(e);
                                        stream_open = false;
                                        break;
                                    }
                                    Ok(actions) => {
                                        output_started = true;
                                        outbox.extend(actions.durable, actions.ephemeral);
                                        if !actions.launch.is_empty() {
                                            // A local call starts only once its `tool.called` committed.
                                            self.send(held, &mut outbox).await?;
                                        }
                                        for launch in actions.launch {
                                            called_tools = true;
                                            self.launch(held, &agent, directory.as_ref(), launch, &tool_cancel, &mut tasks).await?;
                                        }
                                    }
                                },
                            }
                            match stream.next().now_or_never() {
                                Some(next) => item = next,
                                None => break,
                            }
                        }
                        self.send(held, &mut outbox).await?;
                        if let Some(error) = overflow {
                            // Before any output: compact once, then send the step again.
                            compacted = true;
                            match self
                                .compact(held, CompactionReason::Overflow, None, Some((assistant, assistant_seq)), cancel)
                                .await?
                            {
                                Compacted::Done => {
                                    request.turns = context::turns(&self.messages(session).await?);
                                    stream = provider.stream(&request);
                                    stream_open = true;
                                }
                                Compacted::Interrupted => {
                                    interrupted = true;
                                    tool_cancel.cancel();
                                }
                                // A failed summary leaves the original overflow as the step's error.
                                Compacted::Failed(_) => failure = Some(error),
                            }
                        }
                        if let Some((error, wait)) = retry {
                            retries += 1;
                            if self.backoff(held, assistant, retries, &error, wait, cancel).await? {
                                stream = provider.stream(&request);
                                stream_open = true;
                            } else {
                                interrupted = true;
                                tool_cancel.cancel();
                            }
                        }
                    }
                }
            }
            self.send(held, &mut outbox).await?;

            if interrupted {
                last_results.push(DurableEvent::StepInterrupted(payload::StepInterrupted {
                    assistant_message_id: assistant,
                    reason: InterruptReason::User,
                }));
                self.publish(held, last_results).await?;
                return Err(Error::Interrupted);
            }
            let mut closing = last_results;
            closing.extend(publisher.close());
            if failure.is_none() && publisher.finish.is_none() {
                failure = Some(provider::Error::Incomplete(
                    "the stream ended without a finish".into(),
                ));
            }
            let (summary, end) = match (failure, stop) {
                (_, Some(reason)) => (
                    StepSummary {
                        finish: publisher.finish.map(|(f, _)| f),
                        called_tools,
                        stopped: true,
                    },
                    DurableEvent::StepInterrupted(payload::StepInterrupted {
                        assistant_message_id: assistant,
                        reason,
                    }),
                ),
                (Some(error), None) => {
                    let info = error.info();
                    closing.push(DurableEvent::StepFailed(payload::StepFailed {
                        assistant_message_id: assistant,
                        error: info.clone(),
                        usage: publisher.finish.map(|(_, u)| u),
                    }));
                    self.publish(held, closing).await?;
                    return Err(Error::StepFailed(info));
                }
                (None, None) => {
                    let (finish, usage) = publisher.finish.unwrap_or((Finish::Other, Usage::default()));
                    (
                        StepSummary {
                            finish: Some(finish),
                            called_tools,
                            stopped: false,
                        },
                        DurableEvent::StepEnded(payload::StepEnded {
                            assistant_message_id: assistant,
                            finish,
                            usage,
                            cost: 0.0,
                        }),
                    )
                }
            };
            closing.push(end);
            Ok(Ended {
                summary,
                assistant,
                closing,
            })
        }
        .await;
        match result {
            Err(error) if error.breaks_step() => {
                // Any write of the step may have failed; settle it so it ends with exactly
                // one terminal event and no call left running.
                tool_cancel.cancel();
                self.fail_step(held, assistant, &error).await;
                Err(error)
            }
            other => other,
        }
    }

    /// The adapter that serves `model`.
    pub(super) fn provider(&self, model: &ModelRef) -> Result<Arc<dyn Provider>, Error> {
        self.settings
            .providers
            .get(&model.provider)
            .cloned()
            .ok_or_else(|| {
                Error::Config(format!(
                    "no provider `{}` is configured (model {model})",
                    model.provider
                ))
            })
    }

    /// A provider failure and the wait before sending the request again, or the failure
    /// as final: after output began, or when the policy gives up.
    fn retry_or_fail(
        &self,
        error: provider::Error,
        retries: u32,
        output_started: bool,
    ) -> Result<(provider::Error, Duration), provider::Error> {
        if output_started {
            return Err(error);
        }
        match self.settings.retry.delay(retries + 1, &error) {
            Some(wait) => Ok((error, wait)),
            None => Err(error),
        }
    }

    /// Publishes `retry.scheduled` for retry number `retry` after `error` and waits
    /// `wait`; false when an interrupt came first (no further attempt is made).
    async fn backoff(
        &self,
        held: &Held,
        assistant: MessageId,
        retry: u32,
        error: &provider::Error,
        wait: Duration,
        cancel: &CancellationToken,
    ) -> Result<bool, Error> {
        let session = held.claim.session_id;
        let at = self
            .store
            .clock()
            .now_ms()
            .saturating_add(i64::try_from(wait.as_millis()).unwrap_or(i64::MAX));
        tracing::warn!(%session, retry, wait_ms = wait.as_millis(), error = %error, "provider request failed; retrying");
        self.publish(
            held,
            vec![DurableEvent::RetryScheduled(payload::RetryScheduled {
                assistant_message_id: assistant,
                attempt: retry,
                at,
                error: error.info(),
            })],
        )
        .await?;
        tokio::select! {
            () = cancel.cancelled() => Ok(false),
            () = tokio::time::sleep(wait) => {
                if self.owns(held) {
                    Ok(true)
                } else {
                    Err(Error::OwnershipLost(session))
                }
            }
        }
    }

    /// Fails a step that broke off: every unresolved call, then `step.failed`, in one
    /// fenced transaction, retried a few times.
    pub(super) async fn fail_step(&self, held: &Held, assistant: MessageId, cause: &Error) {
        let session = held.claim.session_id;
        let error = ErrorInfo::new("execution.failed", cause.to_string());
        for attempt in 0..4 {
            let error = error.clone();
            let written = self
                .fenced(held, move |c, now| {
                    let open = projector::unresolved_tools(c, session, assistant)?;
                    let mut events: Vec<DurableEvent> = open
                        .into_iter()
                        .map(|call_id| {
                            DurableEvent::ToolFailed(payload::ToolFailed {
                                call_id,
                                error: ErrorInfo::new(
                                    "tool.step-failed",
                                    "the step failed before this call's result was recorded",
                                ),
                            })
                        })
                        .collect();
                    events.push(DurableEvent::StepFailed(payload::StepFailed {
                        assistant_message_id: assistant,
                        error,
                        usage: None,
                    }));
                    crate::event::log::append(c, now, session, events).map_err(Error::from)
                })
                .await;
            match written {
                Ok(envelopes) => {
                    self.broadcast(&envelopes);
                    return;
                }
                Err(Error::OwnershipLost(_)) => return,
                Err(e) => {
                    tracing::warn!(%session, error = %e, attempt, "failing the broken step failed");
                }
            }
        }
    }

    /// Commits the outbox's durable events in one fenced write, then publishes everything
    /// live in the order the provider produced it (runs of deltas coalesced).
    async fn send(&self, held: &Held, outbox: &mut Outbox) -> Result<(), Error> {
        let Outbox { durable, order } = std::mem::take(outbox);
        let mut deltas = Vec::new();
        let mut order = order.into_iter().peekable();
        // Deltas ahead of the first durable event follow what is already committed: they
        // need not wait for this commit.
        while let Some(Outgoing::Ephemeral(event)) =
            order.next_if(|o| matches!(o, Outgoing::Ephemeral(_)))
        {
            deltas.push(event);
        }
        self.publish_deltas(held, &mut deltas);
        if durable.is_empty() {
            return Ok(());
        }
        let session = held.claim.session_id;
        let mut committed = self
            .fenced(held, move |c, now| {
                crate::event::log::append(c, now, session, durable).map_err(Error::from)
            })
            .await?
            .into_iter();
        for item in order {
            match item {
                Outgoing::Ephemeral(event) => deltas.push(event),
                Outgoing::Durable => {
                    self.publish_deltas(held, &mut deltas);
                    if let Some(envelope) = committed.next() {
                        self.broadcast(std::slice::from_ref(&envelope));
                    }
                }
            }
        }
        self.publish_deltas(held, &mut deltas);
        Ok(())
    }

    fn publish_deltas(&self, held: &Held, deltas: &mut Vec<EphemeralEvent>) {
        for event in coalesce(std::mem::take(deltas)) {
            self.publish_ephemeral(held, event);
        }
    }
}

/// A burst of the step's output, in the order the provider produced it, until it is sent:
/// everything the stream has ready commits in one write instead of one per event.
#[derive(Debug, Default)]
struct Outbox {
    /// The durable events, to commit together.
    durable: Vec<DurableEvent>,
    /// Everything in order; `Durable` stands for the next of `durable`.
    order: Vec<Outgoing>,
}

#[derive(Debug)]
enum Outgoing {
    Durable,
    Ephemeral(EphemeralEvent),
}

impl Outbox {
    /// One provider event's output: its durable events come before its deltas.
    fn extend(&mut self, durable: Vec<DurableEvent>, ephemeral: Vec<EphemeralEvent>) {
        self.order.extend(durable.iter().map(|_| Outgoing::Durable));
        self.durable.extend(durable);
        self.order
            .extend(ephemeral.into_iter().map(Outgoing::Ephemeral));
    }
}
