//! Agents end to end: the agents example of docs/tools.md, read from the file, run by
//! `keel serve` against a fake OpenAI-compatible server, with an AGENTS.md in the session
//! directory. Bash rules decide per command, the agent's model, tools and temperature go
//! with its requests, and `GET /api/agents` lists them.

use keel_client::Client;
use keel_client::schema::api::{CreateSession, PermissionReply, PromptRequest, UpdateSession};
use keel_client::schema::event::{DurableEvent, Envelope};
use keel_client::schema::id::SessionId;
use keel_client::schema::types::Decision;
use keel_tests::fake_provider::{Canned, FakeProvider};
use keel_tests::{Server, read_until, workspace_root};
use serde_json::{Value, json};

const EXAMPLE: &str = "# keel.toml: agents with their own model, tools and rules";

/// The TOML block of docs/tools.md that starts with [`EXAMPLE`].
fn documented_example() -> String {
    let docs = std::fs::read_to_string(workspace_root().join("docs/tools.md")).unwrap();
    let start = docs
        .find(EXAMPLE)
        .expect("docs/tools.md holds the agents example");
    let block = &docs[start..];
    block[..block.find("```").expect("the example's block ends")].to_owned()
}

fn settled(envelope: &Envelope) -> bool {
    matches!(envelope.event, DurableEvent::ExecutionSettled(_))
}

/// Each bash call's command with how it ended: `ran` or the failure's kind.
fn bash_outcomes(events: &[Envelope]) -> Vec<(String, String)> {
    let mut calls: Vec<(keel_client::schema::id::CallId, String)> = Vec::new();
    let mut outcomes = Vec::new();
    for envelope in events {
        match &envelope.event {
            DurableEvent::ToolCalled(c) if c.name == "bash" => {
                calls.push((c.call_id, c.input["command"].as_str().unwrap().to_owned()));
            }
            DurableEvent::ToolSuccess(s) => {
                if let Some((_, command)) = calls.iter().find(|(id, _)| *id == s.call_id) {
                    outcomes.push((command.clone(), "ran".to_owned()));
                }
            }
            DurableEvent::ToolFailed(f) => {
                if let Some((_, command)) = calls.iter().find(|(id, _)| *id == f.call_id) {
                    outcomes.push((command.clone(), f.error.kind.clone()));
                }
            }
            _ => {}
        }
    }
    outcomes.sort();
    outcomes
}

fn tool_names(body: &Value) -> Vec<&str> {
    body["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .map(|t| t["function"]["name"].as_str().unwrap())
                .collect()
        })
        .unwrap_or_default()
}

async fn session(client: &Client, server: &Server, agent: Option<&str>) -> SessionId {
    let body = CreateSession {
        directory: Some(server.directory().to_string_lossy().into_owned()),
        agent: agent.map(str::to_owned),
        ..CreateSession::default()
    };
    client.create_session(&body).await.unwrap().id
}

#[tokio::test]
async fn the_documented_agents_example_runs_with_its_rules_models_tools_and_instructions() {
    let bash = |command: &str| ("bash", json!({ "command": command }));
    let fake = FakeProvider::start(vec![
        Canned::chat(
            "Checking first.",
            &[
                bash("git status"),
                bash("git push origin main"),
                bash("rm -rf build"),
            ],
        ),
        Canned::chat("Pushed.", &[]),
        Canned::chat("Looks fine to me.", &[]),
    ])
    .await;
    let config =
        documented_example().replace("http://127.0.0.1:8080/v1", &format!("{}/v1", fake.base_url));
    let server = Server::start_with(
        &[
            ("keel.toml", &config),
            ("AGENTS.md", "Run the checks with `make check`.\n"),
        ],
        &["--config", "keel.toml"],
    );
    let client = Client::new(&server.base_url).unwrap();

    let agents = client.agents().await.unwrap().items;
    let names: Vec<&str> = agents.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["build", "review"]);
    assert_eq!(agents[0].model, None);
    assert!(agents[0].tools.contains(&"write".to_owned()));
    let review = &agents[1];
    assert_eq!(
        review.model.as_ref().unwrap().to_string(),
        "local/qwen2.5-reviewer"
    );
    assert_eq!(review.temperature, Some(0.2));
    let mut offered = review.tools.clone();
    offered.sort();
    assert_eq!(offered, ["bash", "glob", "grep", "list", "read"]);

    // The built-in agent: `git status` runs, `git push` asks, anything else is refused.
    let build = session(&client, &server, None).await;
    let mut log = client.session_log(build, 0);
    client
        .prompt(build, &PromptRequest::text("check and push"))
        .await
        .unwrap();
    let events = read_until(&mut log, |e| {
        matches!(e.event, DurableEvent::PermissionRequested(_))
    })
    .await;
    let DurableEvent::PermissionRequested(asked) = &events.last().unwrap().event else {
        unreachable!()
    };
    assert_eq!(asked.pattern, "git push origin main");
    assert_eq!(asked.rule.as_deref(), Some("git push *"));
    client
        .reply_permission(
            build,
            asked.request_id,
            &PermissionReply {
                decision: Decision::Once,
            },
        )
        .await
        .unwrap();
    let rest = read_until(&mut log, settled).await;
    let all: Vec<Envelope> = events.into_iter().chain(rest).collect();
    assert_eq!(
        bash_outcomes(&all),
        [
            ("git push origin main".to_owned(), "ran".to_owned()),
            ("git status".to_owned(), "ran".to_owned()),
            (
                "rm -rf build".to_owned(),
                "tool.permission-denied".to_owned()
            ),
        ]
    );
    let received = fake.received();
    let first = &received[0].body;
    assert_eq!(first["model"], "qwen2.5-coder");
    assert!(first.get("temperature").is_none(), "{first}");
    // The project's AGENTS.md is part of the system prompt, with its path.
    let system = first["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains("make check") && system.contains("AGENTS.md"),
        "{system}"
    );

    // The review agent: its model, temperature and tools go with its requests.
    let reviewing = session(&client, &server, Some("review")).await;
    let created = client.get_session(reviewing).await.unwrap();
    assert_eq!(created.model.to_string(), "local/qwen2.5-reviewer");
    let mut log = client.session_log(reviewing, 0);
    client
        .prompt(reviewing, &PromptRequest::text("review the change"))
        .await
        .unwrap();
    read_until(&mut log, settled).await;
    let received = fake.received();
    let review_request = &received.last().unwrap().body;
    assert_eq!(review_request["model"], "qwen2.5-reviewer");
    assert_eq!(review_request["temperature"], 0.2);
    let mut sent = tool_names(review_request);
    sent.sort();
    assert_eq!(sent, ["bash", "glob", "grep", "list", "read"]);

    // Switching a session to an agent with a model switches the model too.
    let switched = client
        .update_session(
            build,
            &UpdateSession {
                agent: Some("review".into()),
                ..UpdateSession::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(switched.agent, "review");
    assert_eq!(switched.model.to_string(), "local/qwen2.5-reviewer");
}
