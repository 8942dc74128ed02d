use super::*;

/// Decodes `lines` of `(event, data)`; the first error ends it, as the stream does.
fn decode(lines: &[(&str, Value)]) -> (Vec<Event>, Option<Error>) {
    let mut blocks = Blocks::default();
    let mut events = Vec::new();
    for (event, data) in lines {
        let sse = SseEvent {
            event: (*event).into(),
            data: data.to_string(),
        };
        match blocks.event(sse) {
            Ok(more) => events.extend(more),
            Err(e) => return (events, Some(e)),
        }
    }
    (events, blocks.end().err())
}

fn stop() -> [(&'static str, Value); 2] {
    [
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ]
}

#[test]
fn unknown_events_blocks_and_deltas_are_skipped() {
    let mut lines = vec![
        ("future_event", json!({"type": "future_event", "x": 1})),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "future_block"}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "citations_delta", "citation": {}}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ),
    ];
    lines.extend(stop());
    // Nothing after message_stop counts.
    lines.push(("message_stop", json!({"type": "message_stop"})));
    assert_eq!(
        decode(&lines),
        (
            vec![
                Event::TextStart,
                Event::TextDelta("Hi".into()),
                Event::TextEnd,
                Event::Finish {
                    finish: Finish::Stop,
                    usage: Usage {
                        output: 3,
                        ..Usage::default()
                    },
                },
            ],
            None
        )
    );
}

#[test]
fn a_stream_that_breaks_the_protocol_fails() {
    let (_, error) = decode(&[(
        "content_block_delta",
        json!({"type": "content_block_delta", "index": 4, "delta": {"type": "text_delta", "text": "x"}}),
    )]);
    assert!(
        matches!(&error, Some(Error::Protocol(m)) if m.contains("block 4")),
        "{error:?}"
    );

    let (_, error) = decode(&[
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{"}}),
        ),
    ]);
    assert_eq!(
        error,
        Some(Error::Protocol(
            "a `input_json_delta` in a text block".into()
        ))
    );

    let mut blocks = Blocks::default();
    let error = blocks
        .event(SseEvent {
            event: "message_start".into(),
            data: "{\"type\":\"message_start\",".into(),
        })
        .unwrap_err();
    assert!(matches!(error, Error::Protocol(_)), "{error:?}");
}

#[test]
fn a_hosted_result_for_an_unknown_call_is_skipped_and_an_error_result_fails_the_call() {
    let mut lines = vec![
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "content": []}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "server_tool_use", "id": "srvtoolu_1", "name": "code_execution", "input": {"code": "print(1)"}}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 2, "content_block": {"type": "code_execution_tool_result", "tool_use_id": "srvtoolu_1", "content": {"type": "code_execution_tool_result_error", "error_code": "too_many_requests"}}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 2}),
        ),
    ];
    lines.extend(stop());
    let (events, error) = decode(&lines);
    assert_eq!(error, None);
    assert_eq!(
        events[..4],
        [
            Event::ToolInputStart {
                id: "srvtoolu_1".into(),
                name: "code_execution".into()
            },
            Event::ToolInputDelta {
                id: "srvtoolu_1".into(),
                delta: r#"{"code":"print(1)"}"#.into()
            },
            Event::ToolInputEnd {
                id: "srvtoolu_1".into()
            },
            Event::ToolCall {
                id: "srvtoolu_1".into(),
                name: "code_execution".into(),
                input: r#"{"code":"print(1)"}"#.into(),
                provider_executed: true
            },
        ]
    );
    let Event::ToolResult { id, error, .. } = &events[4] else {
        panic!("{:?}", events[4]);
    };
    assert_eq!(id, "srvtoolu_1");
    assert_eq!(
        error,
        &Some(ErrorInfo::new(
            "provider.tool_failed",
            "Anthropic's code_execution tool failed: too_many_requests"
        ))
    );
}

#[test]
fn error_events_are_typed_by_their_kind() {
    let typed = |kind: &str, message: &str| {
        stream_error(WireError {
            kind: kind.into(),
            message: message.into(),
        })
    };
    assert!(matches!(
        typed("overloaded_error", "Overloaded"),
        Error::Server { status: 529, .. }
    ));
    assert!(matches!(
        typed("api_error", "oops"),
        Error::Server { status: 500, .. }
    ));
    assert!(matches!(
        typed("something_new", "?"),
        Error::Server { status: 500, .. }
    ));
    assert!(matches!(
        typed("rate_limit_error", "slow down"),
        Error::RateLimit {
            retry_after_ms: None,
            ..
        }
    ));
    assert!(matches!(
        typed("authentication_error", "bad key"),
        Error::Auth(_)
    ));
    assert!(matches!(typed("permission_error", "no"), Error::Auth(_)));
    assert!(matches!(
        typed("invalid_request_error", "bad"),
        Error::BadRequest(_)
    ));
    assert_eq!(
        typed(
            "invalid_request_error",
            "prompt is too long: 201000 tokens > 200000 maximum"
        ),
        Error::ContextOverflow(
            "invalid_request_error: prompt is too long: 201000 tokens > 200000 maximum".into()
        )
    );
}

#[test]
fn hosted_results_render_as_short_text() {
    let search = json!([
        {"type": "web_search_result", "title": "Rust", "url": "https://www.rust-lang.org/"},
        {"type": "web_search_result", "url": "https://doc.rust-lang.org/"},
    ]);
    assert_eq!(
        render(&search),
        "Rust <https://www.rust-lang.org/>\nhttps://doc.rust-lang.org/"
    );
    let run =
        json!({"type": "code_execution_result", "stdout": "1\n", "stderr": "", "return_code": 0});
    assert_eq!(render(&run), "1\n");
    let long = "é".repeat(RENDERING);
    assert!(render(&Value::String(long)).ends_with('…'));
}
