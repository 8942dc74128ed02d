//! The invariants a crash campaign checks in each session's log: seq gapless, every
//! admitted input promoted or cancelled once, every step and execution ended once, every
//! tool call resolved at most once (and only left open by its step's interruption). It
//! also collects the `bash` calls each log recorded, which the campaign compares with the
//! calls that really ran.

use std::collections::{HashMap, HashSet};

use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::id::{InputId, SessionId};

use super::Sent;

/// Checks one session's log against the invariants, adding what is wrong to `violations`
/// and the bash calls it recorded to `called`.
pub(super) fn check_session(
    session: SessionId,
    log: &[Envelope],
    ledger: &[Sent],
    called: &mut HashSet<String>,
    violations: &mut Vec<String>,
) {
    let mut fail = |what: String| violations.push(format!("{session}: {what}"));
    for (i, envelope) in log.iter().enumerate() {
        if envelope.seq != i as u64 + 1 {
            fail(format!("seq {} where {} was next", envelope.seq, i + 1));
            break;
        }
    }
    let mut admitted = HashSet::new();
    let mut ended: HashMap<InputId, usize> = HashMap::new();
    let mut steps: HashMap<String, usize> = HashMap::new();
    let mut stopped_early = HashSet::new();
    let mut tools: HashMap<String, (String, usize)> = HashMap::new();
    let mut executions: HashMap<String, usize> = HashMap::new();
    for envelope in log {
        match &envelope.event {
            DurableEvent::PromptAdmitted(p) if !admitted.insert(p.input_id) => {
                fail(format!("input {} admitted twice", p.input_id));
            }
            DurableEvent::Prompted(p) => *ended.entry(p.input_id).or_default() += 1,
            DurableEvent::PromptCancelled(p) => *ended.entry(p.input_id).or_default() += 1,
            DurableEvent::StepStarted(s) => {
                steps.insert(s.assistant_message_id.to_string(), 0);
            }
            DurableEvent::StepEnded(s) => {
                *steps.entry(s.assistant_message_id.to_string()).or_default() += 1;
            }
            DurableEvent::StepFailed(s) => {
                *steps.entry(s.assistant_message_id.to_string()).or_default() += 1;
            }
            DurableEvent::StepInterrupted(s) => {
                *steps.entry(s.assistant_message_id.to_string()).or_default() += 1;
                stopped_early.insert(s.assistant_message_id.to_string());
            }
            DurableEvent::StepRecovered(s) => {
                *steps.entry(s.assistant_message_id.to_string()).or_default() += 1;
                stopped_early.insert(s.assistant_message_id.to_string());
            }
            DurableEvent::ToolCalled(c) => {
                if c.name == "bash" {
                    called.insert(c.call_id.to_string());
                }
                tools.insert(
                    c.call_id.to_string(),
                    (c.assistant_message_id.to_string(), 0),
                );
            }
            DurableEvent::ToolSuccess(r) => {
                if let Some((_, n)) = tools.get_mut(&r.call_id.to_string()) {
                    *n += 1;
                }
            }
            DurableEvent::ToolFailed(r) => {
                if let Some((_, n)) = tools.get_mut(&r.call_id.to_string()) {
                    *n += 1;
                }
            }
            DurableEvent::ExecutionStarted(e) => {
                executions.insert(e.execution_id.to_string(), 0);
            }
            DurableEvent::ExecutionSettled(e) => {
                match executions.get_mut(&e.execution_id.to_string()) {
                    Some(n) => *n += 1,
                    None => fail(format!(
                        "execution {} settled without starting",
                        e.execution_id
                    )),
                }
            }
            _ => {}
        }
    }
    for input in &admitted {
        match ended.get(input).copied().unwrap_or(0) {
            1 => {}
            0 => fail(format!("input {input} was neither promoted nor cancelled")),
            n => fail(format!("input {input} was promoted or cancelled {n} times")),
        }
    }
    for sent in ledger.iter().filter(|s| s.session == session) {
        // The campaign's keys are `inp_` ids, which are the inputs' own ids.
        let Some(id) = sent
            .request
            .id
            .as_deref()
            .and_then(|k| k.parse::<InputId>().ok())
        else {
            continue;
        };
        if !admitted.contains(&id) {
            fail(format!("prompt {id} was sent but never admitted"));
        }
    }
    for (step, n) in &steps {
        if *n != 1 {
            fail(format!("step {step} has {n} terminal events"));
        }
    }
    for (call, (step, results)) in &tools {
        match results {
            1 => {}
            0 if stopped_early.contains(step) => {}
            0 => fail(format!("tool call {call} has no result")),
            n => fail(format!("tool call {call} has {n} results")),
        }
    }
    for (execution, n) in &executions {
        if *n != 1 {
            fail(format!("execution {execution} settled {n} times"));
        }
    }
}
