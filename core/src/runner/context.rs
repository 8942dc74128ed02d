//! Building the provider request from the projected transcript.
//!
//! The transcript is the session's messages in seq order: user messages, synthetic
//! notices (sent as user text), assistant messages (text, reasoning with its provider
//! metadata, tool calls) each followed by exactly one result per call, and, after a
//! compaction, the summary in place of everything before its boundary. A request never holds a
//! call without its result: calls are settled before any continuation is sent.
//!
//! The system prompt is the context epoch's (`crate::epoch`), not the agent's of the
//! moment: a change during the epoch is a message of the transcript, sent as user text
//! ([`SYSTEM_UPDATED`]) where it happened.

use keel_schema::api::{AssistantPart, Message, ToolStatus};
use keel_schema::types::{ErrorInfo, Part};

use super::compaction::message_seq;
use crate::provider::{AssistantItem, ToolResult, Turn};

/// How a system prompt changed during the epoch reaches the model.
pub const SYSTEM_UPDATED: &str = "The system instructions changed. From here on, follow \
    these instead of the ones you were given at the start:";

/// The turns of a transcript. The latest summary stands for every message before its
/// boundary: it comes first, followed by the messages from the boundary on.
pub fn turns(messages: &[Message]) -> Vec<Turn> {
    let latest_summary = messages.iter().rev().find_map(|m| match m {
        Message::Summary {
            boundary_seq,
            summary,
            ..
        } => Some((*boundary_seq, summary)),
        _ => None,
    });
    let mut turns = Vec::new();
    let mut kept: Vec<&Message> = messages
        .iter()
        .filter(|m| !matches!(m, Message::Summary { .. }))
        .collect();
    if let Some((boundary, summary)) = latest_summary {
        kept.retain(|m| message_seq(m) >= boundary);
        turns.push(Turn::User {
            parts: vec![Part::Text {
                text: format!("Summary of the conversation so far:\n{summary}"),
            }],
        });
    }
    for message in kept {
        match message {
            Message::User { parts, .. } => turns.push(Turn::User {
                parts: parts.clone(),
            }),
            Message::Synthetic { text, .. } => turns.push(Turn::User {
                parts: vec![Part::Text { text: text.clone() }],
            }),
            Message::System { system, .. } => turns.push(Turn::User {
                parts: vec![Part::Text {
                    text: format!("{SYSTEM_UPDATED}\n\n{system}"),
                }],
            }),
            Message::Summary { .. } => {}
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
                            provider_result,
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
                                provider_result: provider_result.clone(),
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
