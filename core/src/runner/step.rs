//! One step as a state machine: a provider request, its streamed response, and the local
//! calls it made.
//!
//! A [`Step`] is started by [`Step::start`] (the request built, an automatic compaction
//! when the model's limits call for one, `step.started` written unless the boundary did
//! it) and driven by [`Step::run`]: a loop around one `select!` whose arms each call one
//! method: [`Step::on_stream_batch`] for what the provider has ready,
//! [`Step::on_tool_done`] for a call that finished or got its reply, [`Step::on_cancel`]
//! for an interrupt. The provider's side is one [`Response`] state; the two detours a
//! response can take before any output, [`Step::on_overflow`] (compact once, send again)
//! and [`Step::on_retry`] (wait, send again), are states too, so the step can never be,
//! say, retrying and interrupted at once. Once the response is [`Over`] and every call
//! joined, [`Step::end`] writes or hands back the step's end.
//!
//! Rules kept here: whatever the stream has ready goes out together, its deltas live at
//! once and its durable events in a fenced write that the step does not wait for
//! ([`super::outbox`]); local calls start only after their `tool.called` commits, run
//! concurrently, and are all joined before the step ends, the result of the last one
//! held for the step's end; a hosted call left unresolved
//! at the end of the stream fails ([`super::translate`]). Each step ends in exactly one of
//! `step.ended`, `step.failed` or `step.interrupted`; a step that ended leaves those
//! closing events to the drain ([`Ended`]). A step whose only calls left wait for a person
//! writes `step.awaiting` instead and stays open: the drain hands its execution back, and
//! a later drain takes it up again ([`Step::resume`], [`crate::request`]). Before any output a retryable failure is sent
//! again after a backoff ([`super::retry`]) and a context overflow compacts the history
//! once and sends the request again ([`super::compaction`]); after output, a failure is
//! the step's error.
//!
//! (The type is not called `Turn`: [`crate::provider::Turn`] is one message of a request.)

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keel_schema::event::{DurableEvent, payload};
use keel_schema::id::{CallId, MessageId};
use keel_schema::types::{
    CompactionReason, Effect, ErrorInfo, Finish, InterruptReason, Phase, Usage,
};
use tokio::task::{JoinError, JoinSet};
use tokio_util::sync::CancellationToken;

use super::compaction::{Compacted, estimate_tokens, needs_compaction};
use super::fence::Held;
use super::outbox::Outbox;
use super::receive::{ReadAhead, Received};
use super::tools::{QUESTION, Ran, result_event};
use super::translate::{Known, Translator};
use super::{Agent, Engine, Error, context};
use crate::clock::SharedClock;
use crate::event::view;
use crate::execution;
use crate::provider::{self, EventStream, Provider, ToolChoice};

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
    info: &view::SessionInfo,
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

/// What a step starts from, decided at the boundary before it.
#[derive(Debug)]
pub(super) struct Start {
    pub number: u32,
    /// The session's directory, agent and model.
    pub info: view::SessionInfo,
    /// The assistant message and `step.started` seq, when the boundary wrote that event
    /// ([`start_step`]).
    pub started: Option<(MessageId, u64)>,
    /// The context epoch's system prompt (`crate::epoch`); the agent's when the boundary
    /// established none.
    pub system: Option<String>,
}

/// A step that ended (`step.ended`, or `step.interrupted` after a refused permission or
/// a dismissed question) with its closing events not yet written: the drain commits them
/// in the next boundary's transaction, one write where there were two.
#[derive(Debug)]
pub struct Ended {
    pub summary: StepSummary,
    pub assistant: MessageId,
    /// The last calls' results, the closing of open fragments, and the terminal event
    /// (or `step.awaiting`).
    pub closing: Vec<DurableEvent>,
    /// The step waits for a person: it has no terminal event yet, and the boundary that
    /// commits `closing` hands the execution back unless a reply committed meanwhile.
    pub awaiting: bool,
}

impl Ended {
    /// The boundary after this step: a step boundary when a tool-driven continuation
    /// follows, else an idle one.
    pub fn boundary_after(&self) -> crate::inbox::Boundary {
        if self.summary.continues() {
            crate::inbox::Boundary::Step
        } else {
            crate::inbox::Boundary::Idle
        }
    }
}

/// Where the provider's response stands.
enum Response {
    /// Being read. `said`: the provider has said something, so a failure can no longer be
    /// retried transparently.
    Streaming { stream: ReadAhead, said: bool },
    /// Refused as longer than the model's context, before any output.
    Overflowed(provider::Error),
    /// Failed before any output with an error the policy retries after `wait`.
    Retrying {
        error: provider::Error,
        wait: Duration,
    },
    /// Nothing more will come from the provider.
    Over(Over),
}

/// How a response that is over ended.
enum Over {
    /// Read to its end.
    Ended,
    /// Broke off; the error is the step's, unless a refused reply stopped it first.
    Failed(provider::Error),
    /// An interrupt came: the stream was dropped and the running calls told to stop.
    Interrupted,
}

impl Response {
    fn streaming(stream: EventStream, clock: &SharedClock) -> Self {
        Self::Streaming {
            stream: ReadAhead::start(stream, clock.clone()),
            said: false,
        }
    }

    fn is_streaming(&self) -> bool {
        matches!(self, Self::Streaming { .. })
    }

    fn is_interrupted(&self) -> bool {
        matches!(self, Self::Over(Over::Interrupted))
    }

    /// Read to its end or failed: the provider is done and no interrupt came.
    fn is_finished(&self) -> bool {
        matches!(self, Self::Over(Over::Ended | Over::Failed(_)))
    }
}

/// The next event of a streaming response. `select!` builds every arm's future, enabled
/// or not, so in any other state this waits forever instead.
async fn next_event(response: &mut Response) -> Option<Received> {
    match response {
        Response::Streaming { stream, .. } => stream.next().await,
        _ => std::future::pending().await,
    }
}

/// The tools the model may call, with their effects.
fn known_tools(engine: &Engine) -> HashMap<String, Known> {
    let mut known: HashMap<String, Known> = engine
        .settings
        .tools
        .iter()
        .cloned()
        .chain(engine.settings.mcp.known_tools())
        .map(|t| {
            let known = Known {
                effect: t.effect(),
                rerun: t.rerun_safe(),
            };
            (t.name().to_owned(), known)
        })
        .collect();
    // A question waits for a person; it is never run again.
    let question = Known {
        effect: Effect::Read,
        rerun: false,
    };
    known.insert(QUESTION.into(), question);
    known
}

/// A step that waits for a person, as the log left it: what a resumed step starts from.
#[derive(Debug)]
pub(super) struct Parked {
    pub assistant: MessageId,
    /// The seq of its `step.started`.
    pub seq: u64,
    pub number: u32,
    /// How its response finished, from `step.awaiting`.
    pub finish: Finish,
    pub usage: Usage,
    /// Its calls with an open request, each with the request.
    pub waiting: Vec<(crate::request::Open, super::translate::Launch)>,
}

/// One step of a held session, under way.
pub(super) struct Step<'a> {
    pub(super) engine: &'a Engine,
    pub(super) held: &'a Held,
    pub(super) agent: Agent,
    provider: Arc<dyn Provider>,
    request: provider::Request,
    assistant: MessageId,
    assistant_seq: u64,
    /// The session directory, or why it is not usable (its calls then fail with that).
    pub(super) directory: Result<PathBuf, String>,
    translator: Translator,
    response: Response,
    /// Local calls running.
    pub(super) calls: JoinSet<(CallId, Ran)>,
    /// Local calls whose request waits for a person's reply.
    pub(super) awaiting: Vec<CallId>,
    /// Retries of the request so far.
    retries: u32,
    /// When this process took the step up (its start, or its resumption).
    began: std::time::Instant,
    /// Whether the step compacted already: at most once per logical step.
    compacted: bool,
    /// Whether any local call was made (a continuation follows their results).
    called_tools: bool,
    /// Whether this step was taken up again after waiting for a person (its
    /// `step.awaiting` is written already).
    resumed: bool,
    /// A refused permission or a dismissed question stops the continuation.
    pub(super) stopped: Option<InterruptReason>,
    /// Output read and not yet committed or published.
    pub(super) outbox: Outbox<'a>,
    /// The results of the calls that finished last, held for the step's closing write.
    last_results: Vec<DurableEvent>,
    cancel: &'a CancellationToken,
    /// Tells the step's calls to stop: on an interrupt, and when the step breaks off.
    pub(super) calls_cancel: CancellationToken,
}

impl Engine {
    /// Runs one step of `held`'s session. `turns` is the transcript to send, read at the
    /// boundary before it, like `start`. A step that failed or was interrupted has
    /// written its end; one that ended returns it unwritten.
    pub(super) async fn step(
        &self,
        held: &Held,
        start: Start,
        turns: provider::Turns,
        cancel: &CancellationToken,
    ) -> Result<Ended, Error> {
        use tracing::Instrument as _;
        let span = tracing::info_span!("step", number = start.number, model = %start.info.model);
        async {
            let mut step = Step::start(self, held, start, turns, cancel).await?;
            self.drive(&mut step).await
        }
        .instrument(span)
        .await
    }

    /// Takes up a step that waited for a person (see [`Parked`]) and runs it to its end,
    /// or to its next wait.
    pub(super) async fn resume_step(
        &self,
        held: &Held,
        parked: Parked,
        info: view::SessionInfo,
        cancel: &CancellationToken,
    ) -> Result<Ended, Error> {
        use tracing::Instrument as _;
        let assistant = parked.assistant;
        let span = tracing::info_span!("step", number = parked.number, model = %info.model, resumed = true);
        match Step::resume(self, held, parked, info, cancel)
            .instrument(span.clone())
            .await
        {
            Ok(mut step) => self.drive(&mut step).instrument(span).await,
            Err(error) => {
                if error.breaks_step() {
                    self.fail_step(held, assistant, &error).await;
                }
                Err(error)
            }
        }
    }

    /// Runs a started step to its end; one that breaks off is failed with every call
    /// joined first. The caller owns the step: taken by value, it would be in this
    /// future twice (the argument and the binding it moves to), and it is large.
    async fn drive(&self, step: &mut Step<'_>) -> Result<Ended, Error> {
        let held = step.held;
        match step.run().await {
            Err(error) if error.breaks_step() => {
                // Any write of the step may have failed; settle it so it ends with exactly
                // one terminal event and no call left running: the calls are told to stop
                // and joined first, so nothing a tool does lands after `step.failed`.
                step.calls_cancel.cancel();
                while step.calls.join_next().await.is_some() {}
                self.fail_step(held, step.assistant, &error).await;
                Err(error)
            }
            other => other,
        }
    }
}

impl<'a> Step<'a> {
    /// Builds the request, compacts first when the model's limits call for it, and writes
    /// `step.started` unless the boundary did; that fenced write is the ownership check
    /// before the provider request. Nothing is sent until [`Step::run`] polls the stream.
    async fn start(
        engine: &'a Engine,
        held: &'a Held,
        start: Start,
        turns: provider::Turns,
        cancel: &'a CancellationToken,
    ) -> Result<Self, Error> {
        let Start {
            number,
            info,
            started,
            system,
        } = start;
        let session = held.claim.session_id;
        let agent = engine.agent(&info.agent)?;
        let provider = engine.provider(&info.model)?;
        let last_step = number >= agent.max_steps;
        let limits = engine.limits(&info.model);
        // An MCP server starting on first use may take a while; an interrupt need not wait.
        let tools = tokio::select! {
            tools = engine.request_tools(&info.agent, &agent) => tools,
            () = cancel.cancelled() => return Err(Error::Interrupted),
        };
        let mut request = provider::Request {
            model: info.model.clone(),
            system: system.unwrap_or_else(|| agent.system.clone()),
            turns,
            tools,
            temperature: agent.temperature,
            tool_choice: if last_step {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            },
            max_output_tokens: limits.map(|l| u32::try_from(l.output).unwrap_or(u32::MAX)),
        };
        let mut compacted = false;
        if let Some(limits) = limits
            && needs_compaction(estimate_tokens(&request), limits)
        {
            compacted = true;
            match engine
                .compact(held, CompactionReason::Auto, None, None, cancel)
                .await?
            {
                Compacted::Done { system } => {
                    request.system = system;
                    request.turns = context::turns(&engine.messages(session).await?);
                }
                Compacted::Interrupted => return Err(Error::Interrupted),
                // The step goes ahead; if the provider refuses it as too long, it fails.
                Compacted::Failed(_) => {}
            }
        }
        let (assistant, assistant_seq) = match started {
            Some(started) => started,
            None => {
                let claim = held.claim;
                let info = info.clone();
                let (started, envelopes) = engine
                    .fenced(held, move |c, now| {
                        start_step(c, now, &claim, &info, number)
                    })
                    .await?;
                engine.publish(&envelopes);
                started
            }
        };
        if cancel.is_cancelled() {
            return Err(Error::Interrupted);
        }
        if !engine.owns(held) {
            return Err(Error::OwnershipLost(session));
        }
        let response = Response::streaming(
            crate::metrics::observed(&request, provider.stream(&request)),
            engine.store.clock(),
        );
        let translator = Translator::new(assistant, known_tools(engine), last_step);
        let mut step = Self::assemble(
            engine,
            held,
            agent,
            provider,
            request,
            (assistant, assistant_seq),
            &info.directory,
            translator,
            response,
            cancel,
        );
        step.compacted = compacted;
        Ok(step)
    }

    /// A step that waited for a person, taken up again from the log: its response is
    /// over (`step.awaiting` recorded how it finished), and the replies that committed
    /// meanwhile are acted on ([`Step::act_on_replies`]).
    async fn resume(
        engine: &'a Engine,
        held: &'a Held,
        parked: Parked,
        info: view::SessionInfo,
        cancel: &'a CancellationToken,
    ) -> Result<Self, Error> {
        let agent = engine.agent(&info.agent)?;
        let provider = engine.provider(&info.model)?;
        // Never sent: the response is over. Kept so the step has one shape.
        let request = provider::Request {
            model: info.model.clone(),
            system: agent.system.clone(),
            turns: provider::Turns::default(),
            tools: engine.specs(&info.agent),
            temperature: agent.temperature,
            tool_choice: ToolChoice::Auto,
            max_output_tokens: None,
        };
        let mut translator = Translator::new(parked.assistant, known_tools(engine), false);
        translator.finish = Some((parked.finish, parked.usage));
        let mut step = Self::assemble(
            engine,
            held,
            agent,
            provider,
            request,
            (parked.assistant, parked.seq),
            &info.directory,
            translator,
            Response::Over(Over::Ended),
            cancel,
        );
        step.called_tools = true;
        step.resumed = true;
        step.act_on_replies(parked.waiting).await?;
        Ok(step)
    }

    #[allow(clippy::too_many_arguments)] // The parts a step starts from; one call site each.
    fn assemble(
        engine: &'a Engine,
        held: &'a Held,
        agent: Agent,
        provider: Arc<dyn Provider>,
        request: provider::Request,
        (assistant, assistant_seq): (MessageId, u64),
        directory: &str,
        translator: Translator,
        response: Response,
        cancel: &'a CancellationToken,
    ) -> Self {
        let directory = std::fs::canonicalize(directory)
            .map_err(|e| format!("the session directory {directory} is not usable: {e}"));
        Self {
            engine,
            held,
            agent,
            provider,
            request,
            assistant,
            assistant_seq,
            directory,
            translator,
            response,
            calls: JoinSet::new(),
            awaiting: Vec::new(),
            retries: 0,
            began: std::time::Instant::now(),
            compacted: false,
            called_tools: false,
            resumed: false,
            stopped: None,
            outbox: Outbox::default(),
            last_results: Vec::new(),
            cancel,
            calls_cancel: cancel.child_token(),
        }
    }

    /// The step's assistant message and the seq of its `step.started`.
    pub(super) fn open_step(&self) -> (MessageId, u64) {
        (self.assistant, self.assistant_seq)
    }

    /// Drives the step until its response is over and its calls are joined, then ends it.
    async fn run(&mut self) -> Result<Ended, Error> {
        let over = loop {
            // The detours before any output run to their end before anything else.
            match std::mem::replace(&mut self.response, Response::Over(Over::Ended)) {
                Response::Overflowed(error) => {
                    self.response = self.on_overflow(error).await?;
                    continue;
                }
                Response::Retrying { error, wait } => {
                    self.response = self.on_retry(error, wait).await?;
                    continue;
                }
                Response::Over(over) if self.calls.is_empty() => break over,
                state => self.response = state,
            }
            tokio::select! {
                biased;
                () = self.cancel.cancelled(), if !self.response.is_interrupted() => {
                    self.on_cancel();
                }
                Some(joined) = self.calls.join_next(), if !self.calls.is_empty() => {
                    self.on_tool_done(joined).await?;
                }
                // Before the stream's arm: `biased` polls the arms in order, and the
                // commit is sent to the writer when first polled.
                committed = self.outbox.committed(), if self.outbox.is_committing() => {
                    self.on_committed(committed)?;
                }
                item = next_event(&mut self.response), if self.response.is_streaming() => {
                    self.on_stream_batch(item).await?;
                }
            }
        };
        self.flush().await?;
        self.end(over).await
    }

    /// Whether an interrupt ended the response.
    pub(super) fn is_interrupted(&self) -> bool {
        self.response.is_interrupted()
    }

    /// An interrupt: the stream is dropped, the calls are told to stop.
    fn on_cancel(&mut self) {
        self.response = self.interrupted();
    }

    fn interrupted(&self) -> Response {
        self.calls_cancel.cancel();
        Response::Over(Over::Interrupted)
    }

    /// Takes `first` and everything else the stream has ready, so deltas go out batched
    /// and the durable events commit together, and moves the response on.
    async fn on_stream_batch(&mut self, first: Option<Received>) -> Result<(), Error> {
        let Response::Streaming {
            mut stream,
            mut said,
        } = std::mem::replace(&mut self.response, Response::Over(Over::Ended))
        else {
            // The arm runs only while the response streams.
            return Ok(());
        };
        let mut item = first;
        let next = loop {
            match item {
                // Ended before saying anything: cut short, retried like one.
                None if !said => {
                    break self.retry_or_fail(
                        provider::Error::Incomplete("the stream ended before any output".into()),
                        said,
                    );
                }
                None => break Response::Over(Over::Ended),
                Some((Err(e @ provider::Error::ContextOverflow(_)), _))
                    if !said && !self.compacted =>
                {
                    break Response::Overflowed(e);
                }
                Some((Err(e), _)) => break self.retry_or_fail(e, said),
                // `arrived`: when the event arrived; its deltas carry that time to the
                // client.
                Some((Ok(event), arrived)) => match self.translator.accept(event) {
                    Err(e) => break Response::Over(Over::Failed(e)),
                    Ok(actions) => {
                        said = true;
                        self.outbox
                            .extend(actions.durable, actions.ephemeral, arrived);
                        if !actions.launch.is_empty() {
                            // A local call starts only once its `tool.called` committed.
                            self.flush().await?;
                        }
                        for launch in actions.launch {
                            self.called_tools = true;
                            // Boxed: a launch's writes would otherwise size this
                            // future, which a streaming step holds all along.
                            Box::pin(self.launch(launch)).await?;
                        }
                    }
                },
            }
            match stream.ready() {
                Some(next) => item = next,
                None => break Response::Streaming { stream, said },
            }
        };
        self.send();
        self.response = next;
        Ok(())
    }

    /// A provider failure, retried after a wait when nothing was said yet and the policy
    /// allows another attempt, else the step's error.
    fn retry_or_fail(&self, error: provider::Error, said: bool) -> Response {
        if said {
            return Response::Over(Over::Failed(error));
        }
        match self.engine.settings.retry.delay(self.retries + 1, &error) {
            Some(wait) => Response::Retrying { error, wait },
            None => Response::Over(Over::Failed(error)),
        }
    }

    /// A local call finished: its result is recorded, or held for the step's end when it
    /// is the step's last word.
    async fn on_tool_done(
        &mut self,
        joined: Result<(CallId, Ran), JoinError>,
    ) -> Result<(), Error> {
        let (call_id, result) = joined.map_err(|e| Error::ToolTask(Arc::new(e)))?;
        if self.response.is_finished() && self.calls.is_empty() {
            self.last_results.push(result_event(call_id, result));
            Ok(())
        } else {
            self.settle_call(call_id, result).await
        }
    }

    /// The request was refused as too long before any output: compact once, then send it
    /// again. A failed summary leaves the original overflow as the step's error.
    async fn on_overflow(&mut self, error: provider::Error) -> Result<Response, Error> {
        self.compacted = true;
        let open_step = Some((self.assistant, self.assistant_seq));
        let compacted = self
            .engine
            .compact(
                self.held,
                CompactionReason::Overflow,
                None,
                open_step,
                self.cancel,
            )
            .await?;
        Ok(match compacted {
            Compacted::Done { system } => {
                let session = self.held.claim.session_id;
                self.request.system = system;
                self.request.turns = context::turns(&self.engine.messages(session).await?);
                Response::streaming(
                    self.provider.stream(&self.request),
                    self.engine.store.clock(),
                )
            }
            Compacted::Interrupted => self.interrupted(),
            Compacted::Failed(_) => Response::Over(Over::Failed(error)),
        })
    }

    /// Publishes `retry.scheduled`, waits, and sends the request again; an interrupt
    /// during the wait ends the response with no further attempt.
    async fn on_retry(
        &mut self,
        error: provider::Error,
        wait: Duration,
    ) -> Result<Response, Error> {
        self.retries += 1;
        let (engine, held) = (self.engine, self.held);
        let session = held.claim.session_id;
        let at = engine
            .now()
            .saturating_add(i64::try_from(wait.as_millis()).unwrap_or(i64::MAX));
        tracing::warn!(%session, retry = self.retries, wait_ms = wait.as_millis(), error = %error, "provider request failed; retrying");
        engine
            .commit(
                held,
                vec![DurableEvent::RetryScheduled(payload::RetryScheduled {
                    assistant_message_id: self.assistant,
                    attempt: self.retries,
                    at,
                    error: error.info(),
                })],
            )
            .await?;
        tokio::select! {
            () = self.cancel.cancelled() => Ok(self.interrupted()),
            () = tokio::time::sleep(wait) => {
                if engine.owns(held) {
                    Ok(Response::streaming(
                        crate::metrics::observed(
                            &self.request,
                            self.provider.stream(&self.request),
                        ),
                        engine.store.clock(),
                    ))
                } else {
                    Err(Error::OwnershipLost(session))
                }
            }
        }
    }

    /// Writes the end of an interrupted or failed step; hands an ended one back for the
    /// drain to commit with the next boundary.
    async fn end(&mut self, over: Over) -> Result<Ended, Error> {
        crate::metrics::step_ran(self.began.elapsed());
        let assistant = self.assistant;
        let mut closing = std::mem::take(&mut self.last_results);
        let failure = match over {
            Over::Interrupted => {
                closing.push(DurableEvent::StepInterrupted(payload::StepInterrupted {
                    assistant_message_id: assistant,
                    reason: self.engine.interrupt_reason(self.held),
                }));
                self.engine.commit(self.held, closing).await?;
                return Err(Error::Interrupted);
            }
            Over::Failed(error) => Some(error),
            Over::Ended => None,
        };
        closing.extend(self.translator.close());
        let finish = self.translator.finish;
        let failure = failure.or_else(|| {
            finish
                .is_none()
                .then(|| provider::Error::Incomplete("the stream ended without a finish".into()))
        });
        let (summary, end) = match (failure, self.stopped) {
            (_, Some(reason)) => (
                StepSummary {
                    finish: finish.map(|(f, _)| f),
                    called_tools: self.called_tools,
                    stopped: true,
                },
                DurableEvent::StepInterrupted(payload::StepInterrupted {
                    assistant_message_id: assistant,
                    reason,
                }),
            ),
            (Some(error), None) => {
                let info = error.info();
                // Calls asked about a moment ago cannot be answered any more.
                closing.extend(self.awaiting.drain(..).map(|call_id| {
                    DurableEvent::ToolFailed(payload::ToolFailed {
                        call_id,
                        error: ErrorInfo::new(
                            "tool.step-failed",
                            "the step failed before this call was answered",
                        ),
                    })
                }));
                closing.push(DurableEvent::StepFailed(payload::StepFailed {
                    assistant_message_id: assistant,
                    error: info.clone(),
                    usage: finish.map(|(_, u)| u),
                }));
                self.engine.commit(self.held, closing).await?;
                return Err(Error::StepFailed(info));
            }
            (None, None) if !self.awaiting.is_empty() => {
                // Only calls waiting for a person are left: the step waits, its execution
                // handed back at the next boundary ([`Ended::awaiting`]).
                let (finish, usage) = finish.unwrap_or((Finish::Other, Usage::default()));
                if !self.resumed {
                    closing.push(DurableEvent::StepAwaiting(payload::StepAwaiting {
                        assistant_message_id: assistant,
                        finish,
                        usage,
                    }));
                }
                return Ok(Ended {
                    summary: StepSummary {
                        finish: Some(finish),
                        called_tools: self.called_tools,
                        stopped: false,
                    },
                    assistant,
                    closing,
                    awaiting: true,
                });
            }
            (None, None) => {
                let (finish, usage) = finish.unwrap_or((Finish::Other, Usage::default()));
                (
                    StepSummary {
                        finish: Some(finish),
                        called_tools: self.called_tools,
                        stopped: false,
                    },
                    DurableEvent::StepEnded(payload::StepEnded {
                        assistant_message_id: assistant,
                        finish,
                        cost: self.engine.cost(&self.request.model, &usage),
                        usage,
                    }),
                )
            }
        };
        closing.push(end);
        Ok(Ended {
            summary,
            assistant,
            closing,
            awaiting: false,
        })
    }
}
