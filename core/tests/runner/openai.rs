//! The OpenAI-compatible adapter against recorded Chat Completions transcripts
//! (`tests/fixtures/providers/openai/`), served over real HTTP by a fake provider on
//! 127.0.0.1: through the runner, with the durable events snapshot-tested, and directly
//! for the failures the runner retries.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use keel_core::provider::openai::OpenAi;
use keel_core::provider::{self, Event, Provider, Request, Timeouts, ToolChoice, Turn};
use keel_core::runner::RetryPolicy;
use keel_schema::event::DurableEvent;
use keel_schema::types::{Delivery, Finish, ModelRef, Part};
use keel_tests::fake_provider::{Canned, FakeProvider, Stall};
use keel_tests::transcript;
use serde_json::{Value, json};

use crate::support::{Harness, Setup};

fn fixture(name: &str) -> Canned {
    transcript(&format!("openai/{name}.http"))
}

/// A harness whose `openai` provider talks to a fake server serving `responses`.
async fn harness(responses: Vec<Canned>) -> (Harness, FakeProvider) {
    harness_with(responses, Timeouts::default(), Setup::default()).await
}

/// [`harness`] with the adapter's `timeouts` and the rest of `setup`.
async fn harness_with(
    responses: Vec<Canned>,
    timeouts: Timeouts,
    setup: Setup,
) -> (Harness, FakeProvider) {
    let fake = FakeProvider::start(responses).await;
    let adapter = OpenAi::new(
        Some(format!("{}/v1", fake.base_url)),
        Some("sk-test".into()),
        timeouts,
    )
    .expect("an HTTP client");
    let h = Harness::new(Setup {
        providers: vec![("openai".into(), Arc::new(adapter))],
        ..setup
    })
    .await;
    (h, fake)
}

/// Waits short enough for a test: the fake provider answers at once or not at all.
fn short_timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(5),
        first_byte: Duration::from_millis(300),
        idle: Duration::from_millis(300),
    }
}

/// Prompts a new `openai` session and runs it until it settles.
async fn prompt_and_run(h: &Harness, text: &str) -> keel_schema::id::SessionId {
    let session = h.session_on("openai").await;
    h.admit(session, text, Delivery::Queue).await;
    h.runner.run(session).await.unwrap();
    session
}

/// The messages of the `n`th request the fake provider received.
fn messages(fake: &FakeProvider, n: usize) -> Vec<Value> {
    fake.received()[n].body["messages"]
        .as_array()
        .expect("the request has messages")
        .clone()
}

#[tokio::test]
async fn streamed_text_becomes_one_ended_step() {
    let (h, fake) = harness(vec![fixture("text")]).await;
    let session = prompt_and_run(&h, "Say hello.").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);

    let received = fake.received();
    assert_eq!(received.len(), 1);
    let request = &received[0];
    assert_eq!(request.method, "POST");
    assert_eq!(request.path, "/v1/chat/completions");
    assert_eq!(request.header("authorization"), Some("Bearer sk-test"));
    let body = &request.body;
    assert_eq!(body["model"], "test");
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
    assert_eq!(body["tool_choice"], "auto");
    let messages = messages(&fake, 0);
    assert_eq!(messages[0]["role"], "system");
    assert_eq!(
        messages[1],
        json!({"role": "user", "content": "Say hello."})
    );
    let tools = body["tools"].as_array().unwrap();
    let read = tools
        .iter()
        .find(|t| t["function"]["name"] == "read")
        .expect("the read tool is offered");
    assert_eq!(read["type"], "function");
    assert_eq!(read["function"]["parameters"]["type"], "object");
}

#[tokio::test]
async fn a_tool_call_split_across_chunks_runs_and_is_replayed_on_the_next_turn() {
    let (h, fake) = harness(vec![fixture("tool_call"), fixture("answer")]).await;
    std::fs::create_dir_all(h.workspace.path().join("notes")).unwrap();
    std::fs::write(
        h.workspace.path().join("notes/todo.md"),
        "- ship recovery\n- write docs\n",
    )
    .unwrap();
    let session = prompt_and_run(&h, "What is in notes/todo.md?").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);

    // The second request replays the call, exactly once, and its one result.
    let messages = messages(&fake, 1);
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
    let assistant = &messages[2];
    assert_eq!(assistant["content"], "Let me read the file.");
    let calls = assistant["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "read");
    let arguments: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"path": "notes/todo.md", "offset": 1}));
    assert_eq!(messages[3]["tool_call_id"], calls[0]["id"]);
    assert!(
        messages[3]["content"]
            .as_str()
            .unwrap()
            .contains("ship recovery"),
        "{}",
        messages[3]
    );
}

#[tokio::test]
async fn parallel_calls_interleaved_with_text_each_get_one_result() {
    let (h, fake) = harness(vec![fixture("parallel_tools"), fixture("answer")]).await;
    std::fs::write(h.workspace.path().join("a.txt"), "alpha\n").unwrap();
    std::fs::write(h.workspace.path().join("b.txt"), "beta\n").unwrap();
    let session = prompt_and_run(&h, "Read a.txt and b.txt.").await;
    // The two reads run concurrently, so their results may commit in either order: the
    // kinds are compared, not a snapshot.
    let kinds = h.kinds(session).await;
    let from = kinds.iter().position(|k| k == "step.started").unwrap();
    assert_eq!(
        kinds[from..],
        [
            "step.started",
            "text.started",
            "text.ended",
            "tool.input.started",
            "tool.input.started",
            "tool.input.ended",
            "tool.called",
            "tool.input.ended",
            "tool.called",
            "tool.success",
            "tool.success",
            "step.ended",
            "step.started",
            "text.started",
            "text.ended",
            "step.ended",
            "execution.settled",
        ]
    );

    let messages = messages(&fake, 1);
    let calls = messages[2]["tool_calls"].as_array().unwrap();
    let inputs: Vec<Value> = calls
        .iter()
        .map(|c| serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap())
        .collect();
    assert_eq!(inputs, [json!({"path": "a.txt"}), json!({"path": "b.txt"})]);
    let results: Vec<(&Value, &str)> = messages[3..]
        .iter()
        .map(|m| (&m["tool_call_id"], m["content"].as_str().unwrap()))
        .collect();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0].0, &calls[0]["id"]);
    assert!(results[0].1.contains("alpha"));
    assert_eq!(results[1].0, &calls[1]["id"]);
    assert!(results[1].1.contains("beta"));
}

#[tokio::test]
async fn streamed_reasoning_is_kept_apart_from_the_answer() {
    let (h, _fake) = harness(vec![fixture("reasoning")]).await;
    let session = prompt_and_run(&h, "Greet me.").await;
    insta::assert_json_snapshot!(h.redacted_log(session).await);
}

#[tokio::test]
async fn finish_reasons_map_to_keel_finishes() {
    for (name, finish) in [
        ("text", Finish::Stop),
        ("length", Finish::Length),
        ("content_filter", Finish::ContentFilter),
        ("tool_call", Finish::ToolCalls),
        ("no_done", Finish::Stop),
    ] {
        let events = direct(vec![fixture(name)]).await;
        let last = events.last().unwrap().as_ref().unwrap();
        assert!(
            matches!(last, Event::Finish { finish: f, .. } if *f == finish),
            "{name}: {last:?}"
        );
    }
}

#[tokio::test]
async fn usage_comes_from_the_final_chunk() {
    let events = direct(vec![fixture("text")]).await;
    let Some(Ok(Event::Finish { usage, .. })) = events.last() else {
        panic!("{events:?}");
    };
    // 812 prompt tokens of which 768 were cached.
    assert_eq!((usage.input, usage.cache_read, usage.output), (44, 768, 9));
}

/// What a case expects of the error.
type Expect = fn(&provider::Error) -> bool;

#[tokio::test]
async fn failures_are_typed() {
    let cases: Vec<(Canned, Expect)> = vec![
        (fixture("rate_limit"), |e| {
            matches!(
                e,
                provider::Error::RateLimit {
                    retry_after_ms: Some(3_000),
                    ..
                }
            )
        }),
        (
            fixture("overflow"),
            |e| matches!(e, provider::Error::ContextOverflow(m) if m.contains("maximum context length")),
        ),
        (fixture("overflow_llamacpp"), |e| {
            matches!(e, provider::Error::ContextOverflow(_))
        }),
        (fixture("auth"), |e| matches!(e, provider::Error::Auth(_))),
        (fixture("server_error"), |e| {
            matches!(e, provider::Error::Server { status: 503, .. })
        }),
        (
            fixture("error_mid_stream"),
            |e| matches!(e, provider::Error::Server { message, .. } if message.contains("server had an error")),
        ),
        (fixture("incomplete"), |e| {
            matches!(e, provider::Error::Incomplete(_))
        }),
        (fixture("text").cut(700), |e| {
            matches!(e, provider::Error::TransportAfterSend(_))
        }),
    ];
    for (canned, expected) in cases {
        let events = direct(vec![canned.clone()]).await;
        let error = events
            .iter()
            .find_map(|e| e.as_ref().err())
            .unwrap_or_else(|| panic!("no error from {canned:?}: {events:?}"));
        assert!(expected(error), "{error:?}");
        assert!(
            events.last().unwrap().is_err(),
            "the stream ends at the error"
        );
    }
}

#[tokio::test]
async fn a_refused_connection_fails_before_sending() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    drop(listener);
    let adapter = OpenAi::new(
        Some(format!("http://{address}/v1")),
        None,
        Timeouts::default(),
    )
    .expect("an HTTP client");
    let events: Vec<_> = adapter.stream(&request()).collect().await;
    assert!(
        matches!(events[..], [Err(provider::Error::TransportBeforeSend(_))]),
        "{events:?}"
    );
}

#[tokio::test]
async fn a_provider_that_stalls_is_a_timeout_of_the_stage_it_stalled_in() {
    let adapter = |fake: &FakeProvider| {
        OpenAi::new(Some(fake.base_url.clone()), None, short_timeouts()).expect("an HTTP client")
    };
    let silent = FakeProvider::start(vec![fixture("text").stall(Stall::BeforeHead)]).await;
    let events: Vec<_> = adapter(&silent).stream(&request()).collect().await;
    assert!(
        matches!(
            events[..],
            [Err(provider::Error::Timeout {
                stage: provider::Stage::FirstByte,
                after_ms: 300
            })]
        ),
        "{events:?}"
    );
    let stalled = FakeProvider::start(vec![fixture("text").stall(Stall::InBody(700))]).await;
    let events: Vec<_> = adapter(&stalled).stream(&request()).collect().await;
    assert!(
        matches!(events[0], Ok(Event::TextStart)),
        "the stream spoke before it stalled: {events:?}"
    );
    assert!(
        matches!(
            events.last(),
            Some(Err(provider::Error::Timeout {
                stage: provider::Stage::Idle,
                after_ms: 300
            }))
        ),
        "{events:?}"
    );
    let error = provider::Error::Timeout {
        stage: provider::Stage::Idle,
        after_ms: 300,
    };
    assert!(error.retryable());
    assert_eq!(error.info().kind, "provider.timeout");
}

#[tokio::test]
async fn a_stream_that_stalls_after_output_fails_the_step_with_provider_timeout_and_the_session_goes_idle()
 {
    let (h, _fake) = harness_with(
        vec![fixture("text").stall(Stall::InBody(700))],
        short_timeouts(),
        Setup::default(),
    )
    .await;
    let session = h.session_on("openai").await;
    h.admit(session, "Say hello.", Delivery::Queue).await;
    let outcome = h.runner.run(session).await;
    assert!(outcome.is_err(), "the execution failed: {outcome:?}");
    let log = h.log(session).await;
    let failed = log
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::StepFailed(failed) => Some(failed.error.clone()),
            _ => None,
        })
        .expect("the step failed");
    assert_eq!(failed.kind, "provider.timeout", "{failed:?}");
    let kinds = h.kinds(session).await;
    assert!(
        !kinds.contains(&"retry.scheduled".to_owned()),
        "no retry after output: {kinds:?}"
    );
    assert_eq!(kinds.last().map(String::as_str), Some("execution.settled"));
    assert!(!h.claim_exists(session).await, "the session is idle");
}

#[tokio::test]
async fn a_provider_that_never_answers_is_retried_after_its_first_byte_timeout() {
    let retry = RetryPolicy {
        delays: vec![Duration::from_millis(10)],
        jitter: 0.0,
        ..RetryPolicy::default()
    };
    let (h, fake) = harness_with(
        vec![fixture("text").stall(Stall::BeforeHead), fixture("text")],
        short_timeouts(),
        Setup {
            retry: Some(retry),
            ..Setup::default()
        },
    )
    .await;
    let session = prompt_and_run(&h, "Say hello.").await;
    let retried = h
        .log(session)
        .await
        .iter()
        .find_map(|e| match &e.event {
            DurableEvent::RetryScheduled(retry) => Some(retry.error.clone()),
            _ => None,
        })
        .expect("the request was retried");
    assert_eq!(retried.kind, "provider.timeout", "{retried:?}");
    assert!(h.kinds(session).await.contains(&"step.ended".to_owned()));
    assert_eq!(fake.received().len(), 2);
}

/// A minimal request.
fn request() -> Request {
    Request {
        model: ModelRef {
            provider: "openai".into(),
            id: "gpt-test".into(),
        },
        system: "Be brief.".into(),
        turns: vec![Turn::User {
            parts: vec![Part::Text { text: "hi".into() }],
        }]
        .into(),
        tools: std::sync::Arc::from([]),
        tool_choice: ToolChoice::Auto,
        max_output_tokens: None,
        temperature: None,
    }
}

/// The adapter's events for one request against a fake serving `responses`.
async fn direct(responses: Vec<Canned>) -> Vec<Result<Event, provider::Error>> {
    let fake = FakeProvider::start(responses).await;
    let adapter = OpenAi::new(Some(fake.base_url.clone()), None, Timeouts::default())
        .expect("an HTTP client");
    adapter.stream(&request()).collect().await
}

/// Against the real API, only when `OPENAI_API_KEY` is set (`OPENAI_BASE_URL` and
/// `KEEL_OPENAI_MODEL` optional); skipped, and saying so, otherwise.
#[tokio::test]
async fn live_openai_answers() {
    let Some(key) = std::env::var("OPENAI_API_KEY")
        .ok()
        .filter(|k| !k.is_empty())
    else {
        eprintln!("live_openai_answers: skipped (OPENAI_API_KEY is not set)");
        return;
    };
    let adapter = OpenAi::new(
        std::env::var("OPENAI_BASE_URL").ok(),
        Some(key),
        Timeouts::default(),
    )
    .expect("an HTTP client");
    let mut live = request();
    live.model.id = std::env::var("KEEL_OPENAI_MODEL").unwrap_or_else(|_| "gpt-4.1-mini".into());
    let events: Vec<_> = adapter.stream(&live).collect().await;
    let said: String = events
        .iter()
        .filter_map(|e| match e {
            Ok(Event::TextDelta(text)) => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert!(!said.is_empty(), "{events:?}");
    assert!(
        matches!(events.last(), Some(Ok(Event::Finish { .. }))),
        "{events:?}"
    );
}
