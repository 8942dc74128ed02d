//! Building the provider request from the projected transcript.
//!
//! The transcript is the session's messages in seq order: user messages, synthetic
//! notices (sent as user text), assistant messages (text, reasoning with its provider
//! metadata, tool calls) each followed by exactly one result per call, and, after a
//! compaction, the summary in place of everything before it. A request never holds a
//! call without its result: calls are settled before any continuation is sent.

use keel_schema::api::{AssistantPart, Message, ToolStatus};
use keel_schema::types::{ErrorInfo, Part};

use crate::provider::{AssistantItem, ToolResult, Turn};

/// The turns of a transcript.
pub fn turns(messages: &[Message]) -> Vec<Turn> {
    let mut turns = Vec::new();
    for message in messages {
        match message {
            Message::User { parts, .. } => turns.push(Turn::User {
                parts: parts.clone(),
            }),
            Message::Synthetic { text, .. } => turns.push(Turn::User {
                parts: vec![Part::Text { text: text.clone() }],
            }),
            Message::Summary { summary, .. } => {
                turns.clear();
                turns.push(Turn::User {
                    parts: vec![Part::Text {
                        text: format!("Summary of the conversation so far:\n{summary}"),
                    }],
                });
            }
            Message::Assistant { parts, .. } => {
                let mut items = Vec::new();
                let mut results = Vec::new();
                for part in parts {
                    match part {
                        AssistantPart::Text { text, .. } if !text.is_empty() => {
                            items.push(AssistantItem::Text(text.clone()));
                        }
                        AssistantPart::Text { .. } => {}
                        AssistantPart::Reasoning {
                            text,
                            provider_metadata,
                            ..
                        } => items.push(AssistantItem::Reasoning {
                            text: text.clone(),
                            metadata: provider_metadata.clone(),
                        }),
                        AssistantPart::Tool {
                            call_id,
                            name,
                            input,
                            provider_executed,
                            status,
                            content,
                            error,
                            ..
                        } => {
                            items.push(AssistantItem::ToolCall {
                                id: call_id.to_string(),
                                name: name.clone(),
                                input: input.clone(),
                                provider_executed: *provider_executed,
                            });
                            let output = match (status, error) {
                                (ToolStatus::Completed, _) => Ok(content.clone()),
                                (_, Some(error)) => Err(error.clone()),
                                // Settled before any continuation; say so if one slipped by.
                                (ToolStatus::Pending | ToolStatus::Running, None)
                                | (ToolStatus::Error, None) => Err(ErrorInfo::new(
                                    "tool.unresolved",
                                    "this call has no result",
                                )),
                            };
                            results.push(ToolResult {
                                id: call_id.to_string(),
                                name: name.clone(),
                                output,
                            });
                        }
                    }
                }
                if !items.is_empty() {
                    turns.push(Turn::Assistant { items });
                }
                if !results.is_empty() {
                    turns.push(Turn::ToolResults { results });
                }
            }
        }
    }
    turns
}
