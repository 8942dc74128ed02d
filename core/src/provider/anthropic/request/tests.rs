use keel_schema::types::{ErrorInfo, ModelRef};

use super::*;
use crate::provider::ToolSpec;

fn request(turns: Vec<Turn>) -> Request {
    Request {
        model: ModelRef {
            provider: "anthropic".into(),
            id: "claude-test".into(),
        },
        system: "Be brief.".into(),
        turns: turns.into(),
        tools: vec![ToolSpec {
            name: "read".into(),
            description: "Reads a file.".into(),
            input_schema: json!({"type": "object"}),
        }]
        .into(),
        tool_choice: ToolChoice::Auto,
        max_output_tokens: None,
        temperature: None,
    }
}

fn user(text: &str) -> Turn {
    Turn::User {
        parts: vec![Part::Text { text: text.into() }],
    }
}

fn result(id: &str, output: Result<Vec<ToolContent>, ErrorInfo>) -> ToolResult {
    ToolResult {
        id: id.into(),
        name: "read".into(),
        output,
        provider_result: None,
    }
}

#[test]
fn a_transcript_becomes_alternating_messages_of_blocks_in_the_models_order() {
    let search = json!({
        "type": "web_search_tool_result",
        "tool_use_id": "srvtoolu_01",
        "content": [{"type": "web_search_result", "title": "Rust", "url": "https://www.rust-lang.org/"}],
    });
    let turns = vec![
        user("Find Rust's site, then read a.txt."),
        Turn::Assistant {
            items: vec![
                AssistantItem::Reasoning {
                    text: "Search first.".into(),
                    metadata: Some(json!({"signature": "c2lnbmVk"})),
                },
                AssistantItem::Reasoning {
                    text: String::new(),
                    metadata: Some(json!({"redacted_data": "cmVkYWN0ZWQ="})),
                },
                AssistantItem::ToolCall {
                    id: "call_hosted".into(),
                    name: "web_search".into(),
                    input: json!({"query": "rust"}),
                    provider_executed: true,
                },
                AssistantItem::Text("Found it.".into()),
                AssistantItem::ToolCall {
                    id: "call_local".into(),
                    name: "read".into(),
                    input: json!({"path": "a.txt"}),
                    provider_executed: false,
                },
            ],
        },
        Turn::ToolResults {
            results: vec![
                ToolResult {
                    provider_result: Some(search.clone()),
                    ..result(
                        "call_hosted",
                        Ok(vec![ToolContent::Text {
                            text: "Rust".into(),
                        }]),
                    )
                },
                result(
                    "call_local",
                    Err(ErrorInfo::new("tool.failed", "no such file")),
                ),
            ],
        },
        user("Try b.txt."),
    ];
    assert_eq!(
        body(&request(turns), None, false),
        json!({
            "model": "claude-test",
            "max_tokens": DEFAULT_MAX_TOKENS,
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "Find Rust's site, then read a.txt."},
                ]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Search first.", "signature": "c2lnbmVk"},
                    {"type": "redacted_thinking", "data": "cmVkYWN0ZWQ="},
                    {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_search",
                     "input": {"query": "rust"}},
                    search,
                    {"type": "text", "text": "Found it."},
                    {"type": "tool_use", "id": "call_local", "name": "read",
                     "input": {"path": "a.txt"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_local", "content": [
                        {"type": "text", "text": "no such file (tool.failed)"},
                    ], "is_error": true},
                    {"type": "text", "text": "Try b.txt."},
                ]},
            ],
            "tools": [
                {"name": "read", "description": "Reads a file.", "input_schema": {"type": "object"}},
            ],
            "tool_choice": {"type": "auto"},
            "stream": true,
        })
    );
}

#[test]
fn calls_anthropic_cannot_take_back_are_left_out() {
    let turns = vec![
        user("go"),
        Turn::Assistant {
            items: vec![
                // Another provider's reasoning: no signature.
                AssistantItem::Reasoning {
                    text: "hmm".into(),
                    metadata: None,
                },
                // A hosted call that failed: no raw result, no provider id.
                AssistantItem::ToolCall {
                    id: "call_hosted".into(),
                    name: "web_search".into(),
                    input: json!({}),
                    provider_executed: true,
                },
                AssistantItem::Text("Nothing found.".into()),
            ],
        },
        Turn::ToolResults {
            results: vec![result(
                "call_hosted",
                Err(ErrorInfo::new("provider.tool_failed", "unavailable")),
            )],
        },
        user("Thanks."),
    ];
    assert_eq!(
        body(&request(turns), None, false)["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "go"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Nothing found."}]},
            {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
        ])
    );
}

#[test]
fn images_and_pdfs_go_inline_and_other_files_as_notes() {
    let file = |mime: &str, url: &str| Part::File {
        mime: mime.into(),
        filename: Some("f".into()),
        url: url.into(),
    };
    let turns = vec![Turn::User {
        parts: vec![
            file("image/png", "data:image/png;base64,iVBORw0K"),
            file("application/pdf", "data:application/pdf;base64,JVBERi0x"),
            file("text/csv", "data:text/csv;base64,YSxi"),
            file("text/plain", "data:text/plain,hello"),
            file("image/png", "shots/screen.png"),
        ],
    }];
    assert_eq!(
        body(&request(turns), None, false)["messages"][0]["content"],
        json!([
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}},
            {"type": "text", "text": "[attached file f (text/csv); its content is not shown: this model reads images and PDFs only]"},
            {"type": "text", "text": "[attached file f (text/plain); its content is not shown: this model reads images and PDFs only]"},
            {"type": "text", "text": "[attached file shots/screen.png (image/png), in the session directory]"},
        ])
    );
}

#[test]
fn tool_output_keeps_images_and_leaves_out_empty_text() {
    let turns = vec![
        user("look"),
        Turn::Assistant {
            items: vec![AssistantItem::ToolCall {
                id: "call_1".into(),
                name: "read".into(),
                // Malformed input was kept as its raw text.
                input: json!("{\"path\":"),
                provider_executed: false,
            }],
        },
        Turn::ToolResults {
            results: vec![result(
                "call_1",
                Ok(vec![
                    ToolContent::Text {
                        text: String::new(),
                    },
                    ToolContent::Media {
                        mime: "image/png".into(),
                        data: "iVBORw0K".into(),
                    },
                    ToolContent::Media {
                        mime: "audio/wav".into(),
                        data: "UklGRg==".into(),
                    },
                ]),
            )],
        },
    ];
    let body = body(&request(turns), None, false);
    assert_eq!(body["messages"][1]["content"][0]["input"], json!({}));
    assert_eq!(
        body["messages"][2]["content"],
        json!([{"type": "tool_result", "tool_use_id": "call_1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}},
            {"type": "text", "text": "[audio/wav output, 8 bytes of base64, not shown]"},
        ]}])
    );
}

#[test]
fn prompt_caching_marks_the_system_prompt_and_the_last_block_that_can_carry_a_mark() {
    let turns = vec![
        user("Read a.txt."),
        Turn::Assistant {
            items: vec![
                AssistantItem::Text("Reading.".into()),
                AssistantItem::ToolCall {
                    id: "call_1".into(),
                    name: "read".into(),
                    input: json!({"path": "a.txt"}),
                    provider_executed: false,
                },
            ],
        },
        Turn::ToolResults {
            results: vec![result(
                "call_1",
                Ok(vec![ToolContent::Text {
                    text: "hello".into(),
                }]),
            )],
        },
    ];
    let cached = body(&request(turns.clone()), None, true);
    assert_eq!(
        cached["system"],
        json!([{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}])
    );
    let messages = cached["messages"].as_array().unwrap();
    let marked: Vec<&Value> = messages
        .iter()
        .flat_map(|m| m["content"].as_array().unwrap())
        .filter(|block| block.get("cache_control").is_some())
        .collect();
    assert_eq!(marked.len(), 1, "{cached}");
    assert_eq!(marked[0]["type"], "tool_result");
    assert_eq!(
        messages.last().unwrap()["content"]
            .as_array()
            .unwrap()
            .last(),
        Some(marked[0])
    );
    // Off: the system prompt is plain text and nothing is marked.
    let plain = body(&request(turns), None, false);
    assert_eq!(plain["system"], "Be brief.");
    assert!(!plain.to_string().contains("cache_control"));
}

#[test]
fn a_temperature_is_sent_except_with_extended_thinking() {
    let mut warm = request(vec![user("hi")]);
    warm.temperature = Some(0.5);
    assert_eq!(body(&warm, None, false)["temperature"], json!(0.5));
    let thinking = body(&warm, Some(4_000), false);
    assert!(thinking.get("temperature").is_none(), "{thinking}");
    assert!(
        body(&request(vec![user("hi")]), None, false)
            .get("temperature")
            .is_none()
    );
}

#[test]
fn the_last_step_disables_tools_and_thinking_raises_the_default_limit() {
    let mut last = request(vec![user("hi")]);
    last.tool_choice = ToolChoice::None;
    last.system = String::new();
    let body = body(&last, Some(4_000), true);
    assert_eq!(body["tool_choice"], json!({"type": "none"}));
    assert_eq!(
        body["thinking"],
        json!({"type": "enabled", "budget_tokens": 4_000})
    );
    assert_eq!(body["max_tokens"], json!(4_000 + DEFAULT_MAX_TOKENS));
    assert!(body.get("system").is_none(), "{body}");

    let mut limited = request(vec![user("hi")]);
    limited.max_output_tokens = Some(1_000);
    limited.tools = std::sync::Arc::from([]);
    let body = super::body(&limited, None, false);
    assert_eq!(body["max_tokens"], json!(1_000));
    assert!(
        body.get("tools").is_none() && body.get("tool_choice").is_none(),
        "{body}"
    );
}
