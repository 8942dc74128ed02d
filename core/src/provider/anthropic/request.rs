//! The request body: Keel's transcript as Anthropic messages.
//!
//! Anthropic wants user and assistant messages to alternate, so consecutive turns of one
//! role become one message (tool results followed by a prompt are one user message, the
//! results first). Within an assistant message the blocks keep the model's order: signed
//! thinking, text, `tool_use`, and `server_tool_use` each followed by its raw result
//! block. Results of hosted calls therefore never go into the user message, and a hosted
//! call with no raw result to send (it failed, or another provider ran it) is left out
//! altogether, since Anthropic refuses a `server_tool_use` without its result.

use std::collections::{HashMap, HashSet};

use keel_schema::types::{Part, ToolContent};
use serde_json::{Value, json};

use super::DEFAULT_MAX_TOKENS;
use crate::provider::{AssistantItem, Request, ToolChoice, ToolResult, Turn, Turns};

/// The body of `POST /v1/messages` for `request`; `thinking_budget` turns on extended
/// thinking, `caching` marks two cache breakpoints: one on the system prompt (which caches
/// the tools and the prompt, the same for every request of an epoch) and one on the last
/// block of the conversation, so the next request of the session reads the whole prefix
/// from the cache. Anthropic caches only prefixes above a minimum length and ignores the
/// marks below it.
pub(super) fn body(request: &Request, thinking_budget: Option<u32>, caching: bool) -> Value {
    let max_tokens = request.max_output_tokens.unwrap_or_else(|| {
        thinking_budget.map_or(DEFAULT_MAX_TOKENS, |budget| {
            budget.saturating_add(DEFAULT_MAX_TOKENS)
        })
    });
    let mut body = json!({
        "model": request.model.id,
        "max_tokens": max_tokens,
    });
    let breakpoint = json!({"type": "ephemeral"});
    if !request.system.is_empty() {
        body["system"] = if caching {
            json!([{"type": "text", "text": request.system, "cache_control": breakpoint}])
        } else {
            request.system.as_str().into()
        };
    }
    body["messages"] = messages(&request.turns);
    if caching {
        // Thinking blocks cannot carry a breakpoint; the last block that can does.
        let last = body["messages"]
            .as_array_mut()
            .and_then(|messages| messages.last_mut())
            .and_then(|message| message["content"].as_array_mut())
            .and_then(|content| {
                content.iter_mut().rev().find(|block| {
                    !matches!(
                        block["type"].as_str(),
                        Some("thinking" | "redacted_thinking")
                    )
                })
            });
        if let Some(block) = last {
            block["cache_control"] = breakpoint;
        }
    }
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "name": tool.name,
                    "description": tool.description,
                    "input_schema": tool.input_schema,
                })
            })
            .collect();
        body["tool_choice"] = match request.tool_choice {
            ToolChoice::Auto => json!({"type": "auto"}),
            ToolChoice::None => json!({"type": "none"}),
        };
    }
    match (thinking_budget, request.temperature) {
        (Some(budget), _) => {
            // The API refuses any temperature but its own with extended thinking.
            body["thinking"] = json!({"type": "enabled", "budget_tokens": budget});
        }
        (None, Some(temperature)) => body["temperature"] = temperature.into(),
        (None, None) => {}
    }
    body["stream"] = true.into();
    body
}

/// The transcript as alternating messages.
fn messages(turns: &Turns) -> Value {
    let results: HashMap<&str, &ToolResult> = turns
        .iter()
        .filter_map(|turn| match turn {
            Turn::ToolResults { results } => Some(results),
            Turn::User { .. } | Turn::Assistant { .. } => None,
        })
        .flatten()
        .map(|result| (result.id.as_str(), result))
        .collect();
    let hosted: HashSet<&str> = turns
        .iter()
        .filter_map(|turn| match turn {
            Turn::Assistant { items } => Some(items),
            Turn::User { .. } | Turn::ToolResults { .. } => None,
        })
        .flatten()
        .filter_map(|item| match item {
            AssistantItem::ToolCall {
                id,
                provider_executed: true,
                ..
            } => Some(id.as_str()),
            AssistantItem::ToolCall { .. }
            | AssistantItem::Text(_)
            | AssistantItem::Reasoning { .. } => None,
        })
        .collect();
    let mut messages = Messages::default();
    for turn in turns {
        match turn {
            Turn::User { parts } => messages.push("user", parts.iter().filter_map(part).collect()),
            Turn::Assistant { items } => messages.push(
                "assistant",
                items
                    .iter()
                    .flat_map(|item| assistant_blocks(item, &results))
                    .collect(),
            ),
            Turn::ToolResults { results } => messages.push(
                "user",
                results
                    .iter()
                    .filter(|result| !hosted.contains(result.id.as_str()))
                    .map(tool_result)
                    .collect(),
            ),
        }
    }
    messages
        .0
        .into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect()
}

/// Messages being built: (role, content blocks).
#[derive(Default)]
struct Messages(Vec<(&'static str, Vec<Value>)>);

impl Messages {
    /// Adds blocks, to the last message when it has the same role.
    fn push(&mut self, role: &'static str, blocks: Vec<Value>) {
        if blocks.is_empty() {
            return;
        }
        match self.0.last_mut() {
            Some((last, content)) if *last == role => content.extend(blocks),
            _ => self.0.push((role, blocks)),
        }
    }
}

/// A user part: text, an image or a PDF sent inline, or a note naming a file that is not.
fn part(part: &Part) -> Option<Value> {
    match part {
        Part::Text { text } if text.is_empty() => None,
        Part::Text { text } => Some(text_block(text)),
        Part::File {
            mime,
            filename,
            url,
        } => {
            let inline = base64_data(url).and_then(|data| media_block(mime, data));
            Some(inline.unwrap_or_else(|| {
                text_block(&if url.starts_with("data:") {
                    format!(
                        "[attached file {} ({mime}); its content is not shown: this model \
                         reads images and PDFs only]",
                        filename.as_deref().unwrap_or("without a name"),
                    )
                } else {
                    format!("[attached file {url} ({mime}), in the session directory]")
                })
            }))
        }
    }
}

fn text_block(text: &str) -> Value {
    json!({"type": "text", "text": text})
}

/// The base64 payload of a `data:…;base64,` URL.
fn base64_data(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("data:")?;
    let (meta, data) = rest.split_once(',')?;
    meta.ends_with(";base64").then_some(data)
}

/// An image or PDF block for base64 `data` of type `mime`; `None` for other types.
fn media_block(mime: &str, data: &str) -> Option<Value> {
    let kind = match mime {
        "image/jpeg" | "image/png" | "image/gif" | "image/webp" => "image",
        "application/pdf" => "document",
        _ => return None,
    };
    Some(json!({
        "type": kind,
        "source": {"type": "base64", "media_type": mime, "data": data},
    }))
}

/// The blocks of one assistant item.
fn assistant_blocks(item: &AssistantItem, results: &HashMap<&str, &ToolResult>) -> Vec<Value> {
    match item {
        AssistantItem::Text(text) if text.is_empty() => Vec::new(),
        AssistantItem::Text(text) => vec![text_block(text)],
        AssistantItem::Reasoning { text, metadata } => {
            thinking(text, metadata.as_ref()).into_iter().collect()
        }
        AssistantItem::ToolCall {
            id,
            name,
            input,
            provider_executed: false,
        } => vec![json!({
            "type": "tool_use",
            "id": id,
            "name": name,
            "input": object(input),
        })],
        AssistantItem::ToolCall {
            id,
            name,
            input,
            provider_executed: true,
        } => {
            let raw = results
                .get(id.as_str())
                .and_then(|r| r.provider_result.as_ref());
            // The result block names the provider's id for the call, which Keel's own
            // call id is not; Anthropic requires the two to match.
            let Some((provider_id, raw)) =
                raw.and_then(|raw| result_block(raw).map(|id| (id, raw)))
            else {
                return Vec::new();
            };
            vec![
                json!({
                    "type": "server_tool_use",
                    "id": provider_id,
                    "name": name,
                    "input": object(input),
                }),
                raw.clone(),
            ]
        }
    }
}

/// The thinking block for reasoning Anthropic signed, or its redacted form; `None` for
/// reasoning it would refuse (unsigned: another provider's, or cut off before the
/// signature arrived).
fn thinking(text: &str, metadata: Option<&Value>) -> Option<Value> {
    let metadata = metadata?;
    if let Some(data) = metadata.get("redacted_data").and_then(Value::as_str) {
        return Some(json!({"type": "redacted_thinking", "data": data}));
    }
    let signature = metadata.get("signature").and_then(Value::as_str)?;
    Some(json!({"type": "thinking", "thinking": text, "signature": signature}))
}

/// The provider's call id in a raw hosted result, if it is an Anthropic result block
/// (`web_search_tool_result` and its kin).
fn result_block(raw: &Value) -> Option<&str> {
    let kind = raw.get("type")?.as_str()?;
    if !kind.ends_with("_tool_result") {
        return None;
    }
    raw.get("tool_use_id")?.as_str()
}

/// A call's input as the object Anthropic requires. An input that is not one was
/// malformed when the model wrote it, and its result already says so.
fn object(input: &Value) -> Value {
    if input.is_object() {
        input.clone()
    } else {
        json!({})
    }
}

/// A `tool_result` block: the output, or the error marked `is_error`.
fn tool_result(result: &ToolResult) -> Value {
    let (content, is_error): (Vec<Value>, bool) = match &result.output {
        Ok(content) => (content.iter().filter_map(tool_content).collect(), false),
        Err(error) => (
            vec![text_block(&format!("{} ({})", error.message, error.kind))],
            true,
        ),
    };
    let mut block = json!({"type": "tool_result", "tool_use_id": result.id});
    // Anthropic refuses empty text blocks; a result with nothing to show has no content.
    if !content.is_empty() {
        block["content"] = content.into();
    }
    if is_error {
        block["is_error"] = true.into();
    }
    block
}

/// One piece of tool output: text, an image, or a note for media a result cannot hold.
fn tool_content(content: &ToolContent) -> Option<Value> {
    match content {
        ToolContent::Text { text } if text.is_empty() => None,
        ToolContent::Text { text } => Some(text_block(text)),
        ToolContent::Media { mime, data } => Some(
            media_block(mime, data)
                .filter(|block| block["type"] == "image")
                .unwrap_or_else(|| {
                    text_block(&format!(
                        "[{mime} output, {} bytes of base64, not shown]",
                        data.len()
                    ))
                }),
        ),
    }
}

#[cfg(test)]
mod tests;
