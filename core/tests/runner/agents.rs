//! Agents' own rules: permission patterns (most specific wins, `always` remembers the
//! pattern that asked), safe defaults, the tools an agent offers, its temperature.

use keel_core::runner::{Agent, Live, Permissions, Policy, Reply, Rule};
use keel_schema::event::{DurableEvent, Envelope, payload};
use keel_schema::id::{RequestId, SessionId};
use keel_schema::types::Decision;
use serde_json::json;

use crate::support::{Harness, Setup, call, script, text};

fn bash(command: &str) -> keel_core::provider::scripted::Item {
    call("bash", json!({ "command": command }))
}

fn with_bash(rules: &[(&str, Policy)]) -> Agent {
    Agent {
        permissions: Permissions::allow_all().with(
            "bash",
            Rule::Patterns(rules.iter().map(|(p, x)| ((*p).to_owned(), *x)).collect()),
        ),
        ..Agent::default()
    }
}

/// Runs the session until it settles or waits; returns the permission requests asked
/// during the run.
async fn run(h: &Harness, session: SessionId) -> Vec<payload::PermissionRequested> {
    let mut live = h.runner.subscribe();
    h.runner.run(session).await.unwrap();
    h.until_idle(&h.runner, session).await;
    let mut asked = Vec::new();
    while let Ok(item) = live.try_recv() {
        if let Live::Durable(Envelope {
            event: DurableEvent::PermissionRequested(p),
            ..
        }) = item
        {
            asked.push(p);
        }
    }
    asked
}

/// The commands that ran (`tool.success`) and those refused, in log order.
async fn outcomes(h: &Harness, session: SessionId) -> (Vec<String>, Vec<String>) {
    let log = h.log(session).await;
    let command = |call_id| {
        log.iter()
            .find_map(|e| match &e.event {
                DurableEvent::ToolCalled(c) if c.call_id == call_id => {
                    Some(c.input["command"].as_str().unwrap_or_default().to_owned())
                }
                _ => None,
            })
            .unwrap()
    };
    let (mut ran, mut refused) = (Vec::new(), Vec::new());
    for e in &log {
        match &e.event {
            DurableEvent::ToolSuccess(s) => ran.push(command(s.call_id)),
            DurableEvent::ToolFailed(f) if f.error.kind == "tool.permission-denied" => {
                refused.push(command(f.call_id));
            }
            _ => {}
        }
    }
    (ran, refused)
}

async fn answer(h: &Harness, session: SessionId, request: RequestId, decision: Decision) {
    h.runner
        .reply(session, request, Reply::Permission(decision))
        .await
        .unwrap();
}

#[tokio::test]
async fn the_most_specific_bash_pattern_decides_and_always_remembers_the_rule_that_asked() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![
                bash("echo status"),
                bash("git push origin main"),
                bash("rm -f nothing"),
            ],
            vec![bash("git push upstream dev"), bash("git pushy")],
            vec![text("Done.")],
        ])),
        agent: Some(with_bash(&[
            ("echo *", Policy::Allow),
            ("git push *", Policy::Ask),
            ("*", Policy::Deny),
        ])),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let asked = run(&h, session).await;
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert_eq!(asked[0].pattern, "git push origin main");
    assert_eq!(asked[0].rule.as_deref(), Some("git push *"));
    answer(&h, session, asked[0].request_id, Decision::Always).await;
    let asked = run(&h, session).await;
    // `git push upstream dev` matches the remembered rule; `git pushy` is denied by `*`.
    assert!(asked.is_empty(), "{asked:?}");
    let (ran, refused) = outcomes(&h, session).await;
    assert_eq!(
        ran,
        vec![
            "echo status",
            "git push origin main",
            "git push upstream dev"
        ]
    );
    assert_eq!(refused, vec!["rm -f nothing", "git pushy"]);
}

#[tokio::test]
async fn an_always_answer_to_a_one_word_ask_allows_only_the_same_command_again() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![bash("echo one")],
            vec![bash("echo one"), bash("echo two")],
            vec![text("Done.")],
        ])),
        agent: Some(Agent {
            permissions: Permissions::allow_all().with("bash", Rule::Policy(Policy::Ask)),
            ..Agent::default()
        }),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let asked = run(&h, session).await;
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].rule, None);
    answer(&h, session, asked[0].request_id, Decision::Always).await;
    let asked = run(&h, session).await;
    let patterns: Vec<&str> = asked.iter().map(|a| a.pattern.as_str()).collect();
    assert_eq!(patterns, vec!["echo two"]);
    let (ran, _) = outcomes(&h, session).await;
    assert_eq!(ran, vec!["echo one", "echo one"]);
}

#[tokio::test]
async fn with_no_rules_a_tool_that_writes_asks_and_one_that_reads_runs() {
    let h = Harness::new(Setup {
        script: Some(script(vec![
            vec![
                call("list", json!({})),
                call("write", json!({ "path": "a.txt", "content": "a" })),
                bash("echo hi"),
            ],
            vec![text("Done.")],
        ])),
        agent: Some(Agent::default()),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    let asked = run(&h, session).await;
    let tools: Vec<&str> = asked.iter().map(|a| a.tool.as_str()).collect();
    assert_eq!(tools, vec!["write", "bash"]);
    let log = h.log(session).await;
    let succeeded = log
        .iter()
        .filter(|e| matches!(e.event, DurableEvent::ToolSuccess(_)))
        .count();
    assert_eq!(succeeded, 1, "only `list` ran");
}

#[tokio::test]
async fn an_agent_offers_only_its_tools_and_a_call_of_another_is_refused() {
    let h = Harness::new(Setup {
        script: Some(script(vec![vec![bash("echo hi")], vec![text("Done.")]])),
        agent: Some(Agent {
            tools: Some(vec!["read".into(), "l*".into()]),
            temperature: Some(0.3),
            permissions: Permissions::allow_all(),
            ..Agent::default()
        }),
        ..Setup::default()
    })
    .await;
    let session = h.prompted("go").await;
    assert!(run(&h, session).await.is_empty());
    let (ran, refused) = outcomes(&h, session).await;
    assert!(ran.is_empty());
    assert_eq!(refused, vec!["echo hi"]);
    let log = h.log(session).await;
    assert!(
        log.iter().any(|e| matches!(&e.event,
        DurableEvent::ToolFailed(f) if f.error.message.contains("does not offer the `bash` tool")))
    );
    let requests = h.recording.requests.lock().unwrap();
    let offered: Vec<&str> = requests[0].tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(offered, vec!["read", "list"]);
    assert!(requests.iter().all(|r| r.temperature == Some(0.3)));
}
