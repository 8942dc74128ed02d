//! The drain: promotion at each boundary, then steps until the model stops or nothing is
//! left.
//!
//! A boundary is one fenced transaction: the previous step's end (held back by the step,
//! [`super::step::Ended`]), the promotion of waiting input ([`crate::inbox`]), the
//! transcript brought up to date (held across steps, so a step reads only what changed),
//! the session's settings, the decision whether a step follows ([`next_step`]) and, when
//! nothing must come before it, that step's `step.started`.

use keel_schema::api::{AssistantPart, Message, StepEnd};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{MessageId, SessionId};
use keel_schema::types::{Finish, InterruptReason, Outcome, Phase, Usage};
use tokio_util::sync::CancellationToken;

use super::engine::{interrupt_and_release, lock};
use super::fence::Held;
use super::step::Parked;
use super::translate::Launch;
use super::{Engine, Error, compaction, context, shutdown, step};
use crate::coordinator::Request;
use crate::event::log;
use crate::event::view::{self, Transcript};
use crate::inbox::{self, Boundary, Promotion};
use crate::request::{self, Kind};
use crate::store::{self, Conn, Durable};
use crate::{epoch, execution, instructions};

/// What a boundary's transaction decided.
enum AtBoundary {
    /// The session's step waits for a person and no reply can be acted on yet: its claim
    /// was released (`execution.settled`, outcome `awaiting`) in the same transaction, so
    /// a reply committing later finds no claim and its wake claims afresh.
    HandedBack(Vec<Envelope>),
    /// The session's step waited for a person and a reply can be acted on.
    Resume {
        parked: Parked,
        written: Vec<Envelope>,
        transcript: Transcript,
        info: Option<view::SessionInfo>,
    },
    /// The ordinary boundary: promotion, and the step that follows, if any.
    Next {
        promotion: Promotion,
        written: Vec<Envelope>,
        transcript: Transcript,
        info: Option<view::SessionInfo>,
        next: Option<u32>,
        started: Option<(MessageId, u64)>,
        /// The context epoch's system prompt, when a step follows.
        system: Option<String>,
    },
}

/// Whether any of a waiting step's requests can be acted on: one was answered, or a
/// permission's tool has been allowed `always` since it was asked.
fn any_actionable(
    connection: &mut Conn,
    session: SessionId,
    open: &[request::Open],
) -> Result<bool, store::Error> {
    for open in open {
        if open.reply.is_some()
            || (open.kind == Kind::Permission
                && request::always_allowed(connection, session, &open.tool, &open.pattern)?)
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The waiting step as the log left it: the transcript's last assistant message (open),
/// how its response finished (its `step.awaiting`), and the calls of `open`.
fn parked(
    connection: &mut Conn,
    session: SessionId,
    messages: &[Message],
    open: Vec<request::Open>,
) -> Result<Parked, Error> {
    let corrupt = |what: String| Error::from(store::Error::Corrupt(what));
    let last = messages
        .iter()
        .rev()
        .find(|m| matches!(m, Message::Assistant { .. }));
    let Some(Message::Assistant {
        id,
        seq,
        step,
        parts,
        end: None,
        ..
    }) = last
    else {
        return Err(corrupt(format!(
            "session {session} has open requests but no open step"
        )));
    };
    let kind = DurableEvent::StepAwaiting(payload::StepAwaiting {
        assistant_message_id: *id,
        finish: Finish::Other,
        usage: Usage::default(),
    })
    .type_name();
    let awaiting = log::latest_of_type(connection, session, *seq, kind)?;
    let Some(DurableEvent::StepAwaiting(awaiting)) = awaiting.map(|e| e.event) else {
        return Err(corrupt(format!("step {id} waits without a step.awaiting")));
    };
    let waiting = open
        .into_iter()
        .map(|open| {
            let launch = parts.iter().find_map(|part| match part {
                AssistantPart::Tool {
                    call_id,
                    name,
                    input,
                    ..
                } if *call_id == open.call_id => Some(Launch {
                    call_id: *call_id,
                    name: name.clone(),
                    input: input.clone(),
                }),
                _ => None,
            });
            match launch {
                Some(launch) => Ok((open, launch)),
                None => Err(corrupt(format!(
                    "request {} names call {} that step {id} did not make",
                    open.id, open.call_id
                ))),
            }
        })
        .collect::<Result<_, _>>()?;
    Ok(Parked {
        assistant: *id,
        seq: *seq,
        number: *step,
        finish: awaiting.finish,
        usage: awaiting.usage,
        waiting,
    })
}

impl Engine {
    /// One drain: promotion at boundaries, steps until the model stops or nothing is left.
    pub(super) async fn drain_session(
        &self,
        session: SessionId,
        request: Request,
        cancel: CancellationToken,
    ) -> Result<(), Error> {
        let held = self.held(session).ok_or(Error::OwnershipLost(session))?;
        let mut boundary = Boundary::Idle;
        let mut step_number = 0u32;
        let mut first = true;
        // Held across steps and brought up to date at each boundary, in the boundary's
        // own transaction: a step reads only what changed, not the whole history.
        let mut transcript = Transcript::default();
        // The transcript's turns, converted a block at a time and shared by the requests.
        let mut turns = context::TurnCache::default();
        // The end of the step before this boundary, committed with the boundary's work.
        let mut ended: Option<step::Ended> = None;
        // The session's directory, whose instruction files are read before each boundary.
        let directory = if self.settings.instructions.is_empty() {
            None
        } else {
            self.store
                .read(move |c| view::session_info(c, session))
                .await?
                .map(|info| info.directory)
        };
        loop {
            if cancel.is_cancelled() {
                if let Some(ended) = ended.take() {
                    self.close_step(&held, ended).await?;
                }
                return Err(Error::Interrupted);
            }
            if self.stopping() {
                return self.hand_back_for_shutdown(&held, ended.take()).await;
            }
            // Calls a crash cut off that may run again do so before anything else.
            if first {
                self.run_reruns(&held, &cancel).await?;
            }
            let ending = ended.take();
            let assistant = ending.as_ref().map(|e| e.assistant);
            // A step waiting for a person is looked for where one can be: at the first
            // boundary (a reply woke the session) and after a step that asked.
            let look_for_waits = first || ending.as_ref().is_some_and(|e| e.awaiting);
            let (settings, claim, force) = (self.settings.clone(), held.claim, request.force);
            let counted = step_number;
            let project = self.project_instructions(directory.as_deref()).await;
            let mut carried = Some(std::mem::take(&mut transcript));
            // After a step that called tools another almost always follows, and nothing
            // acts on this boundary irreversibly before that step's first commit, which
            // must reach the disk anyway (the model's tool call, before the tool runs):
            // the boundary commits without waiting for the disk and gets there with it
            // (`crate::store::deferred`), one sync per tool step instead of two. Its
            // events go out live once on disk.
            let defer = ending.is_some() && !look_for_waits && boundary == Boundary::Step;
            let boundary_work = self
                .fenced_as(&held, defer, move |c, now| {
                    // Run again after a conflict, this starts from a transcript read anew:
                    // the one held may have taken in what was rolled back.
                    let mut transcript = carried.take().unwrap_or_default();
                    let mut written = match &ending {
                        Some(ended) => log::append(c, now, session, ended.closing.clone())?,
                        None => Vec::new(),
                    };
                    if look_for_waits {
                        let open = request::open(c, session)?;
                        if !open.is_empty() {
                            // An interrupt another process recorded while the step waited
                            // ends it here rather than being released with the claim.
                            let cancelled = execution::get(c, session)?
                                .is_some_and(|row| row.phase == Phase::Cancelling);
                            if cancelled && let Some(step) = request::waiting_step(c, session)? {
                                written.extend(interrupt_and_release(
                                    c,
                                    now,
                                    settings.lease_ms,
                                    &claim,
                                    Some(step),
                                    InterruptReason::User,
                                )?);
                                return Ok(AtBoundary::HandedBack(written));
                            }
                            if !any_actionable(c, session, &open)? {
                                written.push(execution::release(
                                    c,
                                    now,
                                    settings.lease_ms,
                                    &claim,
                                    Outcome::Awaiting,
                                    None,
                                )?);
                                return Ok(AtBoundary::HandedBack(written));
                            }
                            transcript.refresh(c, session)?;
                            let parked = parked(c, session, transcript.messages(), open)?;
                            let info = view::session_info(c, session)?;
                            return Ok(AtBoundary::Resume {
                                parked,
                                written,
                                transcript,
                                info,
                            });
                        }
                    }
                    let promotion = inbox::promote_into(c, now, session, boundary, &mut written)?;
                    transcript.refresh(c, session)?;
                    let (info, current) = match epoch::with_session(c, session)? {
                        Some((info, epoch)) => (Some(info), epoch),
                        None => (None, None),
                    };
                    let next = next_step(
                        &promotion,
                        boundary,
                        first,
                        force,
                        transcript.messages(),
                        counted,
                    );
                    // The step's context: its epoch, and the agent's system prompt if it
                    // changed (a message the step then sends).
                    let agent = info.as_ref().and_then(|info| settings.agent(&info.agent));
                    let system = match (agent, next) {
                        (Some(agent), Some(_)) => {
                            let wanted = match &project {
                                Some(project) => {
                                    instructions::system_prompt(&agent.system, project)
                                }
                                // Unreadable for now: the prompt in effect stays.
                                None => current.as_ref().map_or_else(
                                    || agent.system.clone(),
                                    |epoch| epoch.effective_system.clone(),
                                ),
                            };
                            let (system, envelopes) =
                                epoch::establish(c, now, session, current, &wanted)?;
                            if !envelopes.is_empty() {
                                written.extend(envelopes);
                                transcript.refresh(c, session)?;
                            }
                            Some(system)
                        }
                        _ => None,
                    };
                    // The step's start rides along when nothing has to come before it.
                    let started = match (&info, next) {
                        (Some(info), Some(number)) if settings.starts_directly(info) => {
                            let (started, envelopes) =
                                step::start_step(c, now, &claim, info, number)?;
                            written.extend(envelopes);
                            Some(started)
                        }
                        _ => None,
                    };
                    Ok(AtBoundary::Next {
                        promotion,
                        written,
                        transcript,
                        info,
                        next,
                        started,
                        system,
                    })
                })
                .await;
            let (boundary_work, on_disk) = match boundary_work {
                Ok((work, on_disk)) => (Ok(work), on_disk),
                Err(error) => (Err(error), Durable::now()),
            };
            // Whatever does not go on to a step the boundary started waits for the disk
            // here: a claim handed back, a step resumed, the drain's end.
            let on_disk = match &boundary_work {
                Ok(AtBoundary::Next {
                    next: Some(_),
                    started: Some(_),
                    ..
                }) => Some(on_disk),
                _ => {
                    on_disk.wait().await?;
                    None
                }
            };
            let (promotion, envelopes, refreshed, info, next, started, system) = match boundary_work
            {
                Ok(AtBoundary::Next {
                    promotion,
                    written,
                    transcript,
                    info,
                    next,
                    started,
                    system,
                }) => (promotion, written, transcript, info, next, started, system),
                Ok(AtBoundary::HandedBack(written)) => {
                    // The claim is gone with the transaction: nothing runs this session
                    // until a reply (or an interrupt) claims it afresh.
                    lock(&self.held).remove(&session);
                    self.publish(&written);
                    return Ok(());
                }
                Ok(AtBoundary::Resume {
                    parked,
                    written,
                    transcript: refreshed,
                    info,
                }) => {
                    transcript = refreshed;
                    self.publish(&written);
                    first = false;
                    step_number = parked.number;
                    let info =
                        info.ok_or_else(|| Error::Config(format!("no session {session}")))?;
                    // Boxed: rare, and as large as a step; in place it would make
                    // every drain twice a step's size.
                    let resumed = self.resume_step(&held, parked, info, &cancel);
                    let step = Box::pin(resumed).await?;
                    boundary = step.boundary_after();
                    ended = Some(step);
                    continue;
                }
                Err(error) => {
                    if let Some(assistant) = assistant {
                        self.step_not_closed(&held, assistant, &error).await;
                    }
                    return Err(error);
                }
            };
            transcript = refreshed;
            match on_disk {
                Some(on_disk) => self.publish_when_durable(&envelopes, on_disk),
                None => self.publish(&envelopes),
            }
            if let Promotion::Control(input) = &promotion {
                // The only control input is `compact`; its outcome is in its events, and
                // a failed compaction leaves the history as it was.
                let compacted = self
                    .compact(
                        &held,
                        keel_schema::types::CompactionReason::Manual,
                        Some(input.id),
                        None,
                        &cancel,
                    )
                    .await?;
                if compacted == compaction::Compacted::Interrupted {
                    return Err(Error::Interrupted);
                }
                continue;
            }
            // Published and promoted: neither is kept in this future while the step runs.
            drop((envelopes, promotion));
            first = false;
            let Some(number) = next else {
                return Ok(());
            };
            step_number = number;
            let info = info.ok_or_else(|| Error::Config(format!("no session {session}")))?;
            let start = step::Start {
                number: step_number,
                info,
                started,
                system,
            };
            let step = self
                .step(
                    &held,
                    start,
                    turns.turns(transcript.messages(), transcript.versions()),
                    &cancel,
                )
                .await?;
            boundary = step.boundary_after();
            ended = Some(step);
        }
    }

    /// A shutdown stops the drain at this boundary: the step that ended here, and the
    /// continuation for after the restart when the work goes on, in one fenced write
    /// ([`super::shutdown`]); the release follows in `settled`.
    async fn hand_back_for_shutdown(
        &self,
        held: &Held,
        ended: Option<step::Ended>,
    ) -> Result<(), Error> {
        let assistant = ended.as_ref().map(|e| e.assistant);
        let closing = ended.map(|e| e.closing).unwrap_or_default();
        let claim = held.claim;
        let written = self
            .fenced(held, move |c, now| {
                let mut written = log::append(c, now, claim.session_id, closing.clone())?;
                written.extend(shutdown::continue_after_restart(c, now, &claim)?);
                Ok(written)
            })
            .await;
        match written {
            Ok(written) => {
                self.publish(&written);
                Err(Error::ShuttingDown)
            }
            Err(error) => {
                if let Some(assistant) = assistant {
                    self.step_not_closed(held, assistant, &error).await;
                }
                Err(error)
            }
        }
    }

    /// Writes a step's end on its own (the drain stops before another boundary). A step
    /// that waits for a person is written like any other; the interrupt's cleanup then
    /// ends it.
    async fn close_step(&self, held: &Held, ended: step::Ended) -> Result<(), Error> {
        let assistant = ended.assistant;
        if let Err(error) = self.commit(held, ended.closing).await {
            self.step_not_closed(held, assistant, &error).await;
            return Err(error);
        }
        Ok(())
    }

    /// A step's end could not be written: a database failure fails the step, so it still
    /// ends with exactly one terminal event and no call left running; a lost claim leaves
    /// it to recovery.
    async fn step_not_closed(&self, held: &Held, assistant: MessageId, error: &Error) {
        if error.breaks_step() {
            self.fail_step(held, assistant, error).await;
        }
    }
}

/// The number of the step that follows a boundary, or `None` when none does. New prompts
/// run a step (from step 1 after an idle boundary, or after the step a crash cut off); past the first boundary, otherwise,
/// only a tool-driven continuation does, or a step whose tool calls were refused would
/// loop; the first boundary also runs one when the transcript waits for the model. A
/// control input runs no step here (the drain carries it out first).
fn next_step(
    promotion: &Promotion,
    boundary: Boundary,
    first: bool,
    force: bool,
    messages: &[Message],
    step_number: u32,
) -> Option<u32> {
    let (go, counted) = match promotion {
        Promotion::Control(_) => return None,
        Promotion::Prompts(_) if boundary == Boundary::Idle => {
            (true, recovered_step(messages).unwrap_or(0))
        }
        Promotion::Prompts(_) => (true, step_number),
        Promotion::Nothing => (
            boundary == Boundary::Step || (first && awaits_model(messages, force)),
            step_number,
        ),
    };
    go.then_some(counted + 1)
}

/// The number of the step a crash cut off, when the transcript's last assistant message
/// is one that recovery settled: the continuation recovery admitted goes on counting from
/// it, so `max_steps` bounds the execution's steps across a recovery, not each drain's.
fn recovered_step(messages: &[Message]) -> Option<u32> {
    let last = messages
        .iter()
        .rev()
        .find(|m| matches!(m, Message::Assistant { .. }));
    match last {
        Some(Message::Assistant {
            step,
            end: Some(StepEnd::Recovered { .. }),
            ..
        }) => Some(*step),
        _ => None,
    }
}

/// Whether the transcript waits for the model: its last message is the user's. `resume`
/// (an explicit run) also continues a step that asked for tools or was cut short; a mere
/// wake does not, so a spurious wake never restarts a finished tool loop.
fn awaits_model(messages: &[Message], resume: bool) -> bool {
    // A changed system prompt is context for the turn that follows, not a turn.
    match messages
        .iter()
        .rev()
        .find(|m| !matches!(m, Message::System { .. }))
    {
        None => false,
        Some(Message::User { .. } | Message::Synthetic { .. }) => true,
        // A summary ends a manual compaction; an automatic one is followed by its
        // continuation.
        Some(Message::Summary { .. } | Message::System { .. }) => false,
        Some(Message::Assistant { end, .. }) => match end {
            Some(StepEnd::Ended {
                finish: Finish::ToolCalls,
            }) => true,
            Some(
                StepEnd::Interrupted { .. } | StepEnd::Recovered { .. } | StepEnd::Failed { .. },
            ) => resume,
            Some(StepEnd::Ended { .. }) | None => false,
        },
    }
}
