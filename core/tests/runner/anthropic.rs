//! The Anthropic adapter against recorded Messages API transcripts
//! (`tests/fixtures/providers/anthropic/`), served over real HTTP by a fake provider on
//! 127.0.0.1: through the runner, with the durable events snapshot-tested and the replay
//! of each turn checked in the next request, and directly for the failures the runner
//! retries.

use std::sync::Arc;

use futures::StreamExt;
use keel_core::coordinator::RunError;
use keel_core::provider::anthropic::{Anthropic, DEFAULT_MAX_TOKENS};
use keel_core::provider::{self, Event, Provider, Request, Timeouts, ToolChoice, Turn};
use keel_core::runner::{self, Agent};
use keel_schema::event::DurableEvent;
use keel_schema::id::SessionId;
use keel_schema::types::{Delivery, ErrorInfo, Finish, ModelRef, Part, Usage};
use keel_tests::fake_provider::{Canned, FakeProvider};
use keel_tests::transcript;
use serde_json::{Value, json};

use crate::support::{Harness, Setup};

fn fixture(name: &str) -> Canned {
    transcript(&format!("anthropic/{name}.http"))
}

/// A harness whose `anthropic` provider talks to a fake server serving `responses`, with
/// a `notes.txt` in the session directory for the recorded calls to read.
async fn harness(responses: Vec<Canned>) -> (Harness, FakeProvider) {
    let fake = FakeProvider::start(responses).await;
    let adapter = Anthropic::new(
        Some(fake.base_url.clone()),
        Some("sk-ant-test".into()),
        Timeouts::default(),
    )
    .expect("an HTTP client");
    let h = Harness::new(Setup {
        providers: vec![("anthropic".into(), Arc::new(adapter))],
        ..Setup::default()
    })
    .await;
    std::fs::write(h.workspace.path().join("notes.txt"), "Ship on Friday.\n").unwrap();
    (h, fake)
}

/// Admits `text` to `session` and runs it until it settles.
async fn prompt(h: &Harness, session: SessionId, text: &str) {
    h.admit(session, text, Delivery::Queue).await;
    h.runner.run(session).await.unwrap();
}

/// A new `anthropic` session that answered `text`.
async fn prompted(h: &Harness, text: &str) -> SessionId {
    let session = h.session_on("anthropic").await;
    prompt(h, session, text).await;
    session
}

/// The messages of the `n`th request the fake provider received, after checking that its
/// one cache breakpoint (prompt caching is on by default) is on the last block that can
/// carry one, and taking it off so replays compare with what Keel stored.
fn messages(fake: &FakeProvider, n: usize) -> Value {
    let mut messages = fake.received()[n].body["messages"].clone();
    let blocks: Vec<&mut Value> = messages
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .flat_map(|m| m["content"].as_array_mut().unwrap().iter_mut())
        .collect();
    let marked: Vec<usize> = blocks
        .iter()
        .enumerate()
        .filter(|(_, b)| b.get("cache_control").is_some())
        .map(|(i, _)| i)
        .collect();
    let last_markable = blocks
        .iter()
        .rposition(|b| !matches!(b["type"].as_str(), Some("thinking" | "redacted_thinking")))
        .unwrap();
    assert_eq!(
        marked,
        [last_markable],
        "one breakpoint, on the last markable block"
    );
    let mut blocks = blocks;
    blocks[last_markable]
        .as_object_mut()
        .unwrap()
        .remove("cache_control");
    messages
}

/// A user message of one text block.
fn user(text: &str) -> Value {
    json!({"role": "user", "content": [{"type": "text", "text": text}]})
}

/// Keel's id and the output the model saw for each local call of the session, in order.
async fn calls(h: &Harness, session: SessionId) -> Vec<(String, Value)> {
    let log = h.log(session).await;
    log.iter()
        .filter_map(|e| match &e.event {
            DurableEvent::ToolCalled(called) if !called.provider_executed => {
                let content = log.iter().find_map(|r| match &r.event {
                    DurableEvent::ToolSuccess(s) if s.call_id == called.call_id => {
                        Some(serde_json::to_value(&s.content).unwrap())
                    }
                    _ => None,
                });
                Some((
                    called.call_id.to_string(),
                    content.expect("the call succeeded"),
                ))
            }
            _ => None,
        })
        .collect()
}

/// A new `anthropic` session whose first step failed on `text`, with the error.
async fn failed(h: &Harness, text: &str) -> (SessionId, ErrorInfo) {
    let session = h.session_on("anthropic").await;
    h.admit(session, text, Delivery::Queue).await;
    match h.runner.run(session).await {
        Err(RunError::Failed(runner::Error::StepFailed(error))) => (session, error),
        other => panic!("the step should fail, not {other:?}"),
    }
}

#[tokio::test]
async fn streamed_text_becomes_one_ended_step_with_its_usage() {
    let (h, fake) = harness(vec![fixture("text")]).await;
    let session = prompted(&h, "Say hello.").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);

    let received = fake.received();
    assert_eq!(received.len(), 1);
    let request = &received[0];
    assert_eq!(
        (request.method.as_str(), request.path.as_str()),
        ("POST", "/v1/messages")
    );
    assert_eq!(request.header("x-api-key"), Some("sk-ant-test"));
    assert_eq!(request.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(request.header("content-type"), Some("application/json"));
    let mut body = request.body.clone();
    let tools = body
        .as_object_mut()
        .unwrap()
        .remove("tools")
        .expect("the tools are offered");
    assert_eq!(
        body,
        json!({
            "model": "test",
            "max_tokens": DEFAULT_MAX_TOKENS,
            // Prompt caching: breakpoints on the system prompt and the conversation.
            "system": [{"type": "text", "text": Agent::default().system,
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Say hello.", "cache_control": {"type": "ephemeral"}},
            ]}],
            "tool_choice": {"type": "auto"},
            "stream": true,
        })
    );
    let tools = tools.as_array().unwrap();
    for tool in tools {
        let fields: Vec<&String> = tool.as_object().unwrap().keys().collect();
        assert_eq!(fields, ["name", "description", "input_schema"], "{tool}");
    }
    let read = tools.iter().find(|t| t["name"] == "read").unwrap();
    assert_eq!(read["input_schema"]["type"], "object");
    assert!(tools.iter().any(|t| t["name"] == "question"));
}

#[tokio::test]
async fn pings_between_events_change_nothing() {
    let (h, _fake) = harness(vec![fixture("pings")]).await;
    let session = prompted(&h, "Are you there?").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);
}

#[tokio::test]
async fn a_tool_call_streamed_in_pieces_runs_and_is_replayed_with_its_result() {
    let (h, fake) = harness(vec![fixture("tool_use"), fixture("answer")]).await;
    let session = prompted(&h, "What do the notes say?").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);

    let [(id, output)] = &calls(&h, session).await[..] else {
        panic!("one call");
    };
    assert_eq!(
        messages(&fake, 1),
        json!([
            user("What do the notes say?"),
            {"role": "assistant", "content": [
                {"type": "text", "text": "I'll read the notes."},
                {"type": "tool_use", "id": id, "name": "read",
                 "input": {"path": "notes.txt", "limit": 20}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id, "content": output},
            ]},
        ])
    );
    assert!(output.to_string().contains("Ship on Friday."), "{output}");
}

#[tokio::test]
async fn parallel_calls_both_run_and_their_results_go_back_in_one_message() {
    let (h, fake) = harness(vec![fixture("parallel_tools"), fixture("answer")]).await;
    let session = prompted(&h, "Read the notes and list the directory.").await;
    // The first call runs while the second streams, so its `tool.success` may commit
    // anywhere after its `tool.called`: the order is checked without the successes.
    let kinds = h.kinds(session).await;
    let from = kinds.iter().position(|k| k == "step.started").unwrap();
    let first_end = kinds.iter().position(|k| k == "step.ended").unwrap();
    let without_results: Vec<&str> = kinds[from..]
        .iter()
        .map(String::as_str)
        .filter(|k| *k != "tool.success")
        .collect();
    assert_eq!(
        without_results,
        [
            "step.started",
            "text.started",
            "text.ended",
            "tool.input.started",
            "tool.input.ended",
            "tool.called",
            "tool.input.started",
            "tool.input.ended",
            "tool.called",
            "step.ended",
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    let successes = kinds[..first_end]
        .iter()
        .filter(|k| *k == "tool.success")
        .count();
    assert_eq!(successes, 2, "{kinds:?}");

    let [(read, read_output), (list, list_output)] = &calls(&h, session).await[..] else {
        panic!("two calls");
    };
    assert_eq!(
        messages(&fake, 1),
        json!([
            user("Read the notes and list the directory."),
            {"role": "assistant", "content": [
                {"type": "text", "text": "Reading the notes and listing the directory."},
                {"type": "tool_use", "id": read, "name": "read", "input": {"path": "notes.txt"}},
                {"type": "tool_use", "id": list, "name": "list", "input": {"path": "."}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": read, "content": read_output},
                {"type": "tool_result", "tool_use_id": list, "content": list_output},
            ]},
        ])
    );
}

#[tokio::test]
async fn thinking_is_kept_with_its_signature_and_replayed_before_the_text_and_call() {
    let (h, fake) = harness(vec![fixture("thinking"), fixture("answer")]).await;
    let session = prompted(&h, "What do the notes say?").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);

    let [(id, output)] = &calls(&h, session).await[..] else {
        panic!("one call");
    };
    assert_eq!(
        messages(&fake, 1),
        json!([
            user("What do the notes say?"),
            {"role": "assistant", "content": [
                {"type": "thinking",
                 "thinking": "The user wants the notes. I should read notes.txt before answering.",
                 "signature": "EqoBCkgIBxABGAIiQL7mZ2Y3dGhpbmtpbmctc2lnbmF0dXJlLWZvci10ZXN0cw"},
                {"type": "text", "text": "Let me read them."},
                {"type": "tool_use", "id": id, "name": "read", "input": {"path": "notes.txt"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id, "content": output},
            ]},
        ])
    );
}

#[tokio::test]
async fn redacted_thinking_is_kept_and_replayed_as_anthropic_sent_it() {
    let (h, fake) = harness(vec![fixture("redacted_thinking"), fixture("answer")]).await;
    let session = prompted(&h, "What is the answer?").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);

    prompt(&h, session, "And the notes?").await;
    assert_eq!(
        messages(&fake, 1),
        json!([
            user("What is the answer?"),
            {"role": "assistant", "content": [
                {"type": "redacted_thinking",
                 "data": "EmwKAhgBEgy3va3pzwq1TKeelRedactedThinkingPayload0"},
                {"type": "text",
                 "text": "I can't share all of my reasoning, but the answer is 42."},
            ]},
            user("And the notes?"),
        ])
    );
}

#[tokio::test]
async fn a_web_search_anthropic_ran_keeps_its_result_and_is_replayed_in_the_assistant_message() {
    let (h, fake) = harness(vec![fixture("web_search"), fixture("answer")]).await;
    let session = prompted(&h, "What is the latest Rust release?").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);

    prompt(&h, session, "Thanks. And the notes?").await;
    let search = "srvtoolu_01WebSearch0000000005";
    assert_eq!(
        messages(&fake, 1),
        json!([
            user("What is the latest Rust release?"),
            {"role": "assistant", "content": [
                {"type": "text", "text": "I'll look that up."},
                {"type": "server_tool_use", "id": search, "name": "web_search",
                 "input": {"query": "latest Rust release"}},
                {"type": "web_search_tool_result", "tool_use_id": search, "content": [
                    {"type": "web_search_result", "title": "Rust 1.91 released",
                     "url": "https://blog.rust-lang.org/2025/10/30/Rust-1.91.0/",
                     "encrypted_content": "EqgfCioIAxgCIiQ3YzE0MmI1Zi1rZWVsLWZpeHR1cmUtMQ",
                     "page_age": "October 30, 2025"},
                    {"type": "web_search_result", "title": "Rust Release Notes",
                     "url": "https://doc.rust-lang.org/releases.html",
                     "encrypted_content": "EqgfCioIAxgCIiQ3YzE0MmI1Zi1rZWVsLWZpeHR1cmUtMg",
                     "page_age": null},
                ]},
                {"type": "text", "text": "The latest release is Rust 1.91."},
            ]},
            user("Thanks. And the notes?"),
        ])
    );
}

#[tokio::test]
async fn a_failed_web_search_fails_its_call_and_is_left_out_of_the_replay() {
    let (h, fake) = harness(vec![fixture("web_search_error"), fixture("answer")]).await;
    let session = prompted(&h, "When was Keel released?").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);

    prompt(&h, session, "Never mind.").await;
    assert_eq!(
        messages(&fake, 1),
        json!([
            user("When was Keel released?"),
            {"role": "assistant", "content": [
                {"type": "text", "text": "I couldn't search any more this turn."},
            ]},
            user("Never mind."),
        ])
    );
}

#[tokio::test]
async fn max_tokens_ends_the_step_with_finish_length() {
    let (h, _fake) = harness(vec![fixture("max_tokens")]).await;
    let session = prompted(&h, "Tell me a long story.").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);
}

#[tokio::test]
async fn refused_credentials_fail_the_step_as_auth() {
    let (h, _fake) = harness(vec![fixture("auth")]).await;
    let (session, error) = failed(&h, "hi").await;
    assert_eq!(
        error,
        ErrorInfo::new(
            "provider.auth",
            "the provider refused the credentials: 401 Unauthorized: invalid x-api-key"
        )
    );
    insta::assert_json_snapshot!(h.redacted_log(session).await);
}

/// A minimal request.
fn request() -> Request {
    Request {
        model: ModelRef {
            provider: "anthropic".into(),
            id: "claude-test".into(),
        },
        system: "Be brief.".into(),
        turns: vec![Turn::User {
            parts: vec![Part::Text { text: "hi".into() }],
        }]
        .into(),
        tools: std::sync::Arc::from([]),
        tool_choice: ToolChoice::Auto,
        max_output_tokens: Some(256),
        temperature: None,
    }
}

/// The adapter's events for one request against a fake serving `canned`, without a key.
async fn direct(canned: Canned) -> Vec<Result<Event, provider::Error>> {
    let fake = FakeProvider::start(vec![canned]).await;
    let adapter = Anthropic::new(Some(fake.base_url.clone()), None, Timeouts::default())
        .expect("an HTTP client");
    let events = adapter.stream(&request()).collect().await;
    assert_eq!(fake.received()[0].header("x-api-key"), None);
    events
}

#[tokio::test]
async fn refusals_the_runner_retries_are_typed_with_their_wait() {
    let cases = [
        (
            "rate_limit",
            provider::Error::RateLimit {
                retry_after_ms: Some(12_000),
                message: "429 Too Many Requests: This request would exceed the rate limit for \
                          your organization of 30,000 input tokens per minute. Please wait \
                          before trying again."
                    .into(),
            },
        ),
        (
            "overloaded",
            provider::Error::Server {
                status: 529,
                message: "529 Overloaded: Overloaded".into(),
            },
        ),
        (
            "server_error",
            provider::Error::Server {
                status: 500,
                message: "500 Internal Server Error: Internal server error".into(),
            },
        ),
    ];
    for (name, error) in cases {
        assert_eq!(direct(fixture(name)).await, [Err(error)], "{name}");
    }
}

/// Through the runner an overflow starts a compaction, which is the runner's business:
/// the adapter's part, the typed error, is checked here.
#[tokio::test]
async fn a_prompt_too_long_and_a_request_too_large_are_context_overflows() {
    assert_eq!(
        direct(fixture("overflow")).await,
        [Err(provider::Error::ContextOverflow(
            "400 Bad Request: prompt is too long: 214113 tokens > 200000 maximum".into()
        ))]
    );
    assert_eq!(
        direct(fixture("request_too_large")).await,
        [Err(provider::Error::ContextOverflow(
            "413 Payload Too Large: Request exceeds the maximum allowed number of bytes.".into()
        ))]
    );
}

#[tokio::test]
async fn a_raw_prompt_too_long_is_recovered_by_one_compaction_and_a_retry_through_the_runner() {
    // The first prompt's answer, then the 400 the API sends for a prompt too long, the
    // summary, and the retried step's answer.
    let (h, fake) = harness(vec![
        fixture("text"),
        fixture("overflow"),
        fixture("answer"),
        fixture("text"),
    ])
    .await;
    let session = prompted(&h, "Hello?").await;
    prompt(&h, session, "And now?").await;

    let kinds: Vec<String> = h.kinds(session).await;
    let from = kinds.iter().rposition(|k| k == "step.started").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "step.started",
            "compaction.started",
            "compaction.ended",
            "context.epoch_started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );
    let log = h.log(session).await;
    let reasons: Vec<_> = log
        .iter()
        .filter_map(|e| match &e.event {
            DurableEvent::CompactionStarted(c) => Some(c.reason),
            _ => None,
        })
        .collect();
    assert_eq!(reasons, [keel_schema::types::CompactionReason::Overflow]);
    assert!(
        !log.iter()
            .any(|e| matches!(e.event, DurableEvent::StepFailed(_)))
    );
    // The retry went out once, starting from the summary.
    assert_eq!(fake.received().len(), 4);
    let retried = messages(&fake, 3).to_string();
    assert!(
        retried.contains("Summary of the conversation so far"),
        "{retried}"
    );
}

#[tokio::test]
async fn an_overloaded_error_mid_stream_ends_the_stream_after_what_came_before() {
    assert_eq!(
        direct(fixture("overloaded_mid_stream")).await,
        [
            Ok(Event::TextStart),
            Ok(Event::TextDelta("Let me think".into())),
            Err(provider::Error::Server {
                status: 529,
                message: "overloaded_error: Overloaded".into(),
            }),
        ]
    );
}

#[tokio::test]
async fn a_stream_without_message_stop_is_incomplete() {
    assert_eq!(
        direct(fixture("incomplete")).await,
        [
            Ok(Event::TextStart),
            Ok(Event::TextDelta("This answer".into())),
            Ok(Event::TextDelta(" stops".into())),
            Ok(Event::TextEnd),
            Err(provider::Error::Incomplete(
                "the response ended before `message_stop`".into()
            )),
        ]
    );
}

#[tokio::test]
async fn a_connection_dropped_mid_body_is_a_transport_failure_after_send() {
    let events = direct(fixture("text").cut(900)).await;
    assert!(
        matches!(
            events.last(),
            Some(Err(provider::Error::TransportAfterSend(_)))
        ),
        "{events:?}"
    );
    assert_eq!(
        events.iter().filter(|e| e.is_err()).count(),
        1,
        "{events:?}"
    );
}

#[tokio::test]
async fn a_whole_stream_decodes_to_the_events_and_usage_it_reports() {
    assert_eq!(
        direct(fixture("answer")).await,
        [
            Ok(Event::TextStart),
            Ok(Event::TextDelta("The notes say".into())),
            Ok(Event::TextDelta(" to ship on Friday.".into())),
            Ok(Event::TextEnd),
            Ok(Event::Finish {
                finish: Finish::Stop,
                usage: Usage {
                    input: 310,
                    output: 9,
                    reasoning: 0,
                    cache_read: 256,
                    cache_write: 0,
                },
            }),
        ]
    );
    let hosted = direct(fixture("web_search_error")).await;
    assert!(
        hosted.contains(&Ok(Event::ToolResult {
            id: "srvtoolu_01WebSearch0000000006".into(),
            result: json!({
                "type": "web_search_tool_result",
                "tool_use_id": "srvtoolu_01WebSearch0000000006",
                "content": {"type": "web_search_tool_result_error", "error_code": "max_uses_exceeded"},
            }),
            content: vec![keel_schema::types::ToolContent::Text {
                text: "Anthropic's web_search tool failed: max_uses_exceeded".into(),
            }],
            error: Some(ErrorInfo::new(
                "provider.tool_failed",
                "Anthropic's web_search tool failed: max_uses_exceeded",
            )),
        })),
        "{hosted:?}"
    );
}

/// Talks to Anthropic itself when `ANTHROPIC_API_KEY` is set (model from
/// `KEEL_ANTHROPIC_MODEL`); otherwise it says it was skipped.
#[tokio::test]
async fn live_anthropic_answers() {
    let Ok(key) = std::env::var("ANTHROPIC_API_KEY") else {
        println!("live_anthropic_answers skipped: ANTHROPIC_API_KEY is not set");
        return;
    };
    let model = std::env::var("KEEL_ANTHROPIC_MODEL").unwrap_or_else(|_| "claude-haiku-4-5".into());
    let adapter = Anthropic::new(None, Some(key), Timeouts::default()).expect("an HTTP client");
    let mut live = request();
    live.model.id = model;
    live.turns = vec![Turn::User {
        parts: vec![Part::Text {
            text: "Reply with the single word: pong".into(),
        }],
    }]
    .into();
    let events: Vec<Event> = adapter
        .stream(&live)
        .map(|e| e.expect("Anthropic answers"))
        .collect()
        .await;
    let text: String = events
        .iter()
        .filter_map(|e| match e {
            Event::TextDelta(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert!(text.to_lowercase().contains("pong"), "{events:?}");
    assert!(
        matches!(
            events.last(),
            Some(Event::Finish {
                finish: Finish::Stop,
                usage
            }) if usage.input > 0 && usage.output > 0
        ),
        "{events:?}"
    );
}
