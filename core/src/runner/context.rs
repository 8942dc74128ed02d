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

use std::sync::Arc;

use keel_schema::api::{AssistantPart, Message, ToolStatus};
use keel_schema::types::{ErrorInfo, Part};

use super::compaction::message_seq;
use crate::provider::{AssistantItem, ToolResult, Turn, TurnBlock, Turns};

/// How a system prompt changed during the epoch reaches the model.
pub const SYSTEM_UPDATED: &str = "The system instructions changed. From here on, follow \
    these instead of the ones you were given at the start:";

/// Messages per block of a [`TurnCache`]: a request shares the blocks of the history and
/// rebuilds only those holding a message that changed (in a running session, the last).
const BLOCK: usize = 64;

/// The turns of a transcript. The latest summary stands for every message before its
/// boundary: it comes first, followed by the messages from the boundary on.
pub fn turns(messages: &[Message]) -> Turns {
    turn_list(messages).into()
}

/// [`turns`] as a list, for a request that adds its own turns to the history.
pub fn turn_list(messages: &[Message]) -> Vec<Turn> {
    let summary = latest_summary(messages);
    let mut turns: Vec<Turn> = summary
        .map(|(_, text)| summary_turn(text))
        .into_iter()
        .collect();
    for message in messages {
        message_turns(message, summary.map(|(boundary, _)| boundary), &mut turns);
    }
    turns
}

/// The turns of a session's transcript, kept from one step to the next: the messages are
/// converted a block at a time, and a block is converted again only when one of its
/// messages was written since (its `updated_seq` moved) or the latest summary did, so a
/// long run's requests share the history instead of copying it at every step.
#[derive(Debug, Default)]
pub struct TurnCache {
    blocks: Vec<Cached>,
}

#[derive(Debug)]
struct Cached {
    /// Each message's seq and `updated_seq` when the block was built.
    versions: Vec<(u64, i64)>,
    boundary: Option<u64>,
    turns: Arc<TurnBlock>,
}

impl TurnCache {
    /// The turns of `messages`, whose `versions` are each message's seq and
    /// `updated_seq` ([`crate::event::view::Transcript::versions`]); the same as
    /// [`turns`] of the same messages.
    pub fn turns(&mut self, messages: &[Message], versions: &[(u64, i64)]) -> Turns {
        debug_assert_eq!(messages.len(), versions.len());
        let summary = latest_summary(messages);
        let boundary = summary.map(|(boundary, _)| boundary);
        let mut blocks: Vec<Arc<TurnBlock>> = summary
            .map(|(_, text)| Arc::new(TurnBlock::new(vec![summary_turn(text)])))
            .into_iter()
            .collect();
        let chunks = messages.chunks(BLOCK).zip(versions.chunks(BLOCK));
        for (n, (chunk, chunk_versions)) in chunks.enumerate() {
            let fresh = self
                .blocks
                .get(n)
                .is_some_and(|c| c.boundary == boundary && c.versions == chunk_versions);
            if !fresh {
                let mut turns = Vec::new();
                for message in chunk {
                    message_turns(message, boundary, &mut turns);
                }
                let cached = Cached {
                    versions: chunk_versions.to_vec(),
                    boundary,
                    turns: Arc::new(TurnBlock::new(turns)),
                };
                match self.blocks.get_mut(n) {
                    Some(slot) => *slot = cached,
                    None => self.blocks.push(cached),
                }
            }
            if !self.blocks[n].turns.turns().is_empty() {
                blocks.push(Arc::clone(&self.blocks[n].turns));
            }
        }
        self.blocks.truncate(messages.len().div_ceil(BLOCK));
        Turns::from_blocks(blocks)
    }
}

/// The latest summary's boundary and text.
fn latest_summary(messages: &[Message]) -> Option<(u64, &str)> {
    messages.iter().rev().find_map(|m| match m {
        Message::Summary {
            boundary_seq,
            summary,
            ..
        } => Some((*boundary_seq, summary.as_str())),
        _ => None,
    })
}

fn summary_turn(summary: &str) -> Turn {
    Turn::User {
        parts: vec![Part::Text {
            text: format!("Summary of the conversation so far:\n{summary}"),
        }],
    }
}

/// Appends `message`'s turns to `turns`: none for a summary, or for a message from before
/// the latest summary's `boundary`.
fn message_turns(message: &Message, boundary: Option<u64>, turns: &mut Vec<Turn>) {
    if boundary.is_some_and(|boundary| message_seq(message) < boundary) {
        return;
    }
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
                            | (ToolStatus::Error, None) => {
                                Err(ErrorInfo::new("tool.unresolved", "this call has no result"))
                            }
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

#[cfg(test)]
mod tests {
    use keel_schema::id::{CallId, InputId, MessageId};
    use keel_schema::types::{Effect, ModelRef, ToolContent, Usage};
    use serde_json::json;

    use super::*;
    use crate::provider::Request;

    fn user(seq: u64, text: &str) -> Message {
        Message::User {
            id: MessageId::new(),
            seq,
            input_id: InputId::new(),
            parts: vec![Part::Text { text: text.into() }],
        }
    }

    fn assistant(seq: u64, status: ToolStatus) -> Message {
        Message::Assistant {
            id: MessageId::new(),
            seq,
            step: 1,
            agent: "build".into(),
            model: "test/scripted".parse::<ModelRef>().unwrap(),
            parts: vec![
                AssistantPart::Text {
                    ordinal: 0,
                    text: format!("step at {seq}"),
                },
                AssistantPart::Tool {
                    call_id: CallId::new(),
                    name: "write".into(),
                    input: json!({"path": "out.txt", "content": seq.to_string()}),
                    effect: Effect::Write,
                    provider_executed: false,
                    status,
                    content: vec![ToolContent::Text {
                        text: format!("wrote {seq}"),
                    }],
                    error: None,
                    provider_result: None,
                },
            ],
            end: None,
            usage: Usage::default(),
            cost: 0.0,
        }
    }

    /// The cache against [`turns`] as a transcript grows, its last message changes, and a
    /// summary moves the start: the same turns every time, and the settled blocks shared.
    #[test]
    fn the_cache_gives_the_turns_of_the_whole_transcript_and_shares_settled_blocks() {
        let mut cache = TurnCache::default();
        let mut messages = Vec::new();
        let mut versions = Vec::new();
        let mut seq = 0u64;
        let mut previous: Option<Turns> = None;
        for step in 0..300u64 {
            seq += 1;
            messages.push(user(seq, &format!("prompt {step}")));
            versions.push((seq, seq as i64));
            seq += 1;
            messages.push(assistant(seq, ToolStatus::Running));
            versions.push((seq, seq as i64));
            // The call's result updates the same message at a later seq.
            seq += 1;
            let last = messages.len() - 1;
            messages[last] = {
                let Message::Assistant { id, parts, .. } = &messages[last] else {
                    unreachable!()
                };
                let mut parts = parts.clone();
                if let AssistantPart::Tool { status, .. } = &mut parts[1] {
                    *status = ToolStatus::Completed;
                }
                Message::Assistant {
                    id: *id,
                    seq: versions[last].0,
                    step: 1,
                    agent: "build".into(),
                    model: "test/scripted".parse().unwrap(),
                    parts,
                    end: None,
                    usage: Usage::default(),
                    cost: 0.0,
                }
            };
            versions[last].1 = seq as i64;
            if step == 200 {
                seq += 1;
                messages.push(Message::Summary {
                    seq,
                    boundary_seq: seq - 40,
                    summary: "So far: writes.".into(),
                });
                versions.push((seq, seq as i64));
            }
            let cached = cache.turns(&messages, &versions);
            let expected = turns(&messages);
            assert_eq!(cached, expected, "step {step}");
            let request = Request {
                model: "test/scripted".parse().unwrap(),
                system: String::new(),
                turns: cached.clone(),
                tools: Arc::from(Vec::new()),
                tool_choice: crate::provider::ToolChoice::Auto,
                max_output_tokens: None,
                temperature: None,
            };
            let uncached = Request {
                turns: expected,
                ..request.clone()
            };
            assert_eq!(request.approximate_chars(), uncached.approximate_chars());
            assert_eq!(request.assistant_turns(), uncached.assistant_turns());
            if let Some(previous) = &previous
                && step < 200
                && messages.len() > BLOCK * 2
            {
                // Before the summary, the first block is built once and shared, not copied.
                assert!(
                    Arc::ptr_eq(&previous.blocks()[0], &cached.blocks()[0]),
                    "step {step}"
                );
            }
            previous = Some(cached);
        }
    }
}
