//! The invariants a crash campaign checks in each session's log: seq gapless, every
//! admitted input promoted or cancelled once, every step and execution ended once, every
//! tool call resolved at most once (and only left open by its step's interruption). It
//! also collects the `bash` calls each log recorded, which the campaign compares with the
//! calls that really ran, and (`--permissions`) checks the permission requests against
//! the replies clients sent.

use std::collections::{HashMap, HashSet};

use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::id::{InputId, RequestId, SessionId};
use keel_client::schema::types::Decision;

use super::{Answer, Replied, Sent};

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

/// Checks one session's permission requests against the replies clients sent
/// (`--permissions`): every acknowledged reply is in the log as sent, no request has two
/// replies, no call succeeded after a rejection, and every call of a tool that asks
/// (`asking`) that succeeded, or (`bash`) ran, was allowed: by its own reply, or by an
/// `always` to a request of its tool about the same command or path (the campaign's
/// rules are one word per tool, so no request names a pattern `rule`), given before its
/// success; for a run seen only in the side file, anywhere in the log, since a sibling's
/// `always` may come after its call.
pub(super) fn check_permissions(
    session: SessionId,
    log: &[Envelope],
    replies: &[Replied],
    asking: &[&str],
    runs: &HashMap<&str, usize>,
    violations: &mut Vec<String>,
) {
    let mut fail = |what: String| violations.push(format!("{session}: {what}"));
    // Request → (call, (tool, pattern)); call → its request; request → its replies, in
    // order.
    let mut requests: HashMap<RequestId, (String, (String, String))> = HashMap::new();
    let mut request_of: HashMap<String, RequestId> = HashMap::new();
    let mut decisions: HashMap<RequestId, Vec<Decision>> = HashMap::new();
    // Per tool and pattern, the seq of its first `always`.
    let mut always_at: HashMap<(String, String), u64> = HashMap::new();
    // Calls of asking tools: call → (tool, what it touches), and the seq of their success.
    let mut asked_calls: HashMap<String, (String, String)> = HashMap::new();
    let mut succeeded_at: HashMap<String, u64> = HashMap::new();
    for envelope in log {
        match &envelope.event {
            DurableEvent::PermissionRequested(r) => {
                if let Some(rule) = &r.rule {
                    fail(format!(
                        "request {} names the rule `{rule}`, which no rule of the campaign has",
                        r.request_id
                    ));
                }
                let asked = (r.tool.clone(), r.pattern.clone());
                requests.insert(r.request_id, (r.call_id.to_string(), asked));
                request_of.insert(r.call_id.to_string(), r.request_id);
            }
            DurableEvent::PermissionReplied(r) => {
                decisions.entry(r.request_id).or_default().push(r.decision);
                if r.decision == Decision::Always
                    && let Some((_, asked)) = requests.get(&r.request_id)
                {
                    always_at.entry(asked.clone()).or_insert(envelope.seq);
                }
            }
            DurableEvent::ToolCalled(c) if asking.contains(&c.name.as_str()) => {
                // What its permission covers: the command, or the (plain, relative) path.
                let touches = c.input["command"]
                    .as_str()
                    .or(c.input["path"].as_str())
                    .unwrap_or_default();
                asked_calls.insert(c.call_id.to_string(), (c.name.clone(), touches.to_owned()));
            }
            DurableEvent::ToolSuccess(r) => {
                succeeded_at.insert(r.call_id.to_string(), envelope.seq);
            }
            _ => {}
        }
    }
    for (request, logged) in &decisions {
        if logged.len() > 1 {
            fail(format!(
                "request {request} was answered {} times",
                logged.len()
            ));
        }
        if logged.first() == Some(&Decision::Reject)
            && let Some((call, _)) = requests.get(request)
            && succeeded_at.contains_key(call)
        {
            fail(format!(
                "call {call} succeeded although its request was rejected"
            ));
        }
    }
    for reply in replies
        .iter()
        .filter(|r| r.session == session && r.answer == Answer::Accepted)
    {
        match decisions.get(&reply.request).and_then(|d| d.first()) {
            Some(logged) if *logged == reply.decision => {}
            Some(logged) => fail(format!(
                "request {} was acknowledged as {:?} but logged as {logged:?}",
                reply.request, reply.decision
            )),
            None => fail(format!(
                "the acknowledged reply to request {} is not in the log",
                reply.request
            )),
        }
    }
    let allowed_by_reply = |call: &str| {
        request_of.get(call).is_some_and(|request| {
            matches!(
                decisions.get(request).and_then(|d| d.first()),
                Some(Decision::Once | Decision::Always)
            )
        })
    };
    for (call, asked) in &asked_calls {
        let tool = &asked.0;
        let always = always_at.get(asked).copied();
        if let Some(&at) = succeeded_at.get(call) {
            if !allowed_by_reply(call) && always.is_none_or(|always| always >= at) {
                fail(format!(
                    "{tool} call {call} succeeded without being allowed"
                ));
            }
        } else if runs.contains_key(call.as_str()) && !allowed_by_reply(call) && always.is_none() {
            fail(format!("{tool} call {call} ran without being allowed"));
        }
    }
}

/// Checks the MCP server's log (`call NAME` when a call arrived, `done NAME` when it
/// answered) against the sessions' logs: the server received no more `record` calls than
/// were durably called, since a call cut by a kill is failed by recovery and never sent
/// again; and every `record` call that succeeded was answered by the server.
pub(super) fn check_mcp_records(
    server_log: &str,
    logs: &[Vec<Envelope>],
    violations: &mut Vec<String>,
) {
    let count = |line: &str| server_log.lines().filter(|l| *l == line).count();
    let (received, answered) = (count("call record"), count("done record"));
    let mut record_calls = HashSet::new();
    let (mut called, mut succeeded) = (0, 0);
    for envelope in logs.iter().flatten() {
        match &envelope.event {
            DurableEvent::ToolCalled(c) if c.name == "fixture_record" => {
                record_calls.insert(c.call_id);
                called += 1;
            }
            DurableEvent::ToolSuccess(s) if record_calls.contains(&s.call_id) => succeeded += 1,
            _ => {}
        }
    }
    if received > called {
        violations.push(format!(
            "the MCP server received {received} record calls, but only {called} were called"
        ));
    }
    if succeeded > answered {
        violations.push(format!(
            "{succeeded} record calls succeeded, but the MCP server answered {answered}"
        ));
    }
}

#[cfg(test)]
mod tests {
    use keel_client::schema::event::payload;
    use keel_client::schema::id::{CallId, EventId, MessageId};
    use keel_client::schema::types::Effect;
    use serde_json::json;

    use super::*;

    /// A log of one session: `bash` calls of `commands`, the first asked and answered
    /// `always`, every call succeeding.
    fn log(session: SessionId, commands: &[&str]) -> Vec<Envelope> {
        let message = MessageId::new();
        let request = RequestId::new();
        let mut events = Vec::new();
        for (n, command) in commands.iter().enumerate() {
            let call_id = CallId::new();
            events.push(DurableEvent::ToolCalled(payload::ToolCalled {
                assistant_message_id: message,
                call_id,
                name: "bash".into(),
                input: json!({ "command": command }),
                provider_executed: false,
                effect: Effect::Write,
                provider_call_id: None,
                rerun: false,
            }));
            if n == 0 {
                events.push(DurableEvent::PermissionRequested(
                    payload::PermissionRequested {
                        request_id: request,
                        call_id,
                        tool: "bash".into(),
                        pattern: (*command).into(),
                        rule: None,
                    },
                ));
                events.push(DurableEvent::PermissionReplied(
                    payload::PermissionReplied {
                        request_id: request,
                        decision: Decision::Always,
                    },
                ));
            }
            events.push(DurableEvent::ToolSuccess(payload::ToolSuccess {
                call_id,
                structured: json!({}),
                content: Vec::new(),
                result: None,
            }));
        }
        events
            .into_iter()
            .enumerate()
            .map(|(n, event)| Envelope {
                id: EventId::new(),
                session_id: session,
                seq: n as u64 + 1,
                time: 0,
                event,
            })
            .collect()
    }

    fn violations(commands: &[&str]) -> Vec<String> {
        let session = SessionId::new();
        let mut violations = Vec::new();
        let log = log(session, commands);
        check_permissions(
            session,
            &log,
            &[],
            &["bash"],
            &HashMap::new(),
            &mut violations,
        );
        violations
    }

    #[test]
    fn mcp_records_beyond_the_durable_calls_are_violations() {
        let session = SessionId::new();
        let mut logs = vec![log(session, &["x"])];
        // One durable call of `fixture_record`, which succeeded.
        for envelope in &mut logs[0] {
            if let DurableEvent::ToolCalled(c) = &mut envelope.event {
                c.name = "fixture_record".into();
            }
        }
        let check = |server_log: &str| {
            let mut violations = Vec::new();
            check_mcp_records(server_log, &logs, &mut violations);
            violations
        };
        assert!(check("call record\ndone record\n").is_empty());
        assert_eq!(check("call record\ncall record\ndone record\n").len(), 1);
        assert_eq!(
            check("call record\n").len(),
            1,
            "succeeded but never answered"
        );
    }

    #[test]
    fn an_always_covers_later_calls_of_the_same_command_and_no_other() {
        assert_eq!(violations(&["make", "make"]), Vec::<String>::new());
        let other = violations(&["make", "rm -rf /"]);
        assert_eq!(other.len(), 1, "{other:?}");
        assert!(other[0].contains("succeeded without being allowed"));
    }
}
