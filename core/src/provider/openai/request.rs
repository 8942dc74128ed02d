//! The request body: Keel's transcript as Chat Completions messages.
//!
//! The system prompt is the first message; each user turn is a `user` message (text, or
//! parts with images as data URLs); an assistant turn is one `assistant` message with its
//! text and `tool_calls`, followed by one `tool` message per result. Calls another
//! provider ran itself are left out with their results: Chat Completions has no place for
//! them.

use keel_schema::types::{Part, ToolContent};
use serde_json::{Value, json};

use crate::provider::{AssistantItem, Request, ToolChoice, ToolResult, Turn};

/// The request body; `limit_field` names the output limit.
pub(super) fn body(request: &Request, limit_field: &str) -> Value {
    let mut messages = vec![json!({"role": "system", "content": request.system})];
    let mut hosted: Vec<&str> = Vec::new();
    for turn in &request.turns {
        match turn {
            Turn::User { parts } => {
                messages.push(json!({"role": "user", "content": user_content(parts)}))
            }
            Turn::Assistant { items } => messages.push(assistant(items, &mut hosted)),
            Turn::ToolResults { results } => messages.extend(
                results
                    .iter()
                    .filter(|r| !hosted.contains(&r.id.as_str()))
                    .map(tool_message),
            ),
        }
    }
    let mut body = json!({
        "model": request.model.id,
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|tool| {
                json!({"type": "function", "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                }})
            })
            .collect();
        body["tool_choice"] = match request.tool_choice {
            ToolChoice::Auto => "auto",
            ToolChoice::None => "none",
        }
        .into();
    }
    if let Some(max) = request.max_output_tokens {
        body[limit_field] = max.into();
    }
    if let Some(temperature) = request.temperature {
        body["temperature"] = temperature.into();
    }
    body
}

/// A user turn: plain text when it is only text, else content parts.
fn user_content(parts: &[Part]) -> Value {
    if let [Part::Text { text }] = parts {
        return text.as_str().into();
    }
    parts
        .iter()
        .map(|part| match part {
            Part::Text { text } => json!({"type": "text", "text": text}),
            Part::File { mime, url, .. }
                if mime.starts_with("image/") && url.starts_with("data:") =>
            {
                json!({"type": "image_url", "image_url": {"url": url}})
            }
            Part::File {
                mime,
                filename,
                url,
            } => json!({
                "type": "text",
                "text": format!("[file {} ({mime})]", filename.as_deref().unwrap_or(url)),
            }),
        })
        .collect()
}

/// An assistant turn; notes in `hosted` the calls another provider ran itself.
fn assistant<'a>(items: &'a [AssistantItem], hosted: &mut Vec<&'a str>) -> Value {
    let mut text = String::new();
    let mut calls = Vec::new();
    for item in items {
        match item {
            AssistantItem::Text(t) => text.push_str(t),
            AssistantItem::Reasoning { .. } => {}
            AssistantItem::ToolCall {
                id,
                provider_executed: true,
                ..
            } => hosted.push(id),
            AssistantItem::ToolCall {
                id, name, input, ..
            } => calls.push(json!({
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": input.to_string()},
            })),
        }
    }
    let mut message = json!({
        "role": "assistant",
        "content": if text.is_empty() { Value::Null } else { text.into() },
    });
    if !calls.is_empty() {
        message["tool_calls"] = calls.into();
    }
    message
}

/// A tool result: its text, media described (tool messages carry text only), or the
/// error the model should see.
fn tool_message(result: &ToolResult) -> Value {
    let content = match &result.output {
        Ok(content) => content
            .iter()
            .map(|c| match c {
                ToolContent::Text { text } => text.clone(),
                ToolContent::Media { mime, data } => {
                    format!("[{mime} output, {} bytes of base64, not shown]", data.len())
                }
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Err(error) => format!("Error ({}): {}", error.kind, error.message),
    };
    json!({"role": "tool", "tool_call_id": result.id, "content": content})
}
