//! How `keel prompt` shows a session's activity on the terminal.

use std::collections::{HashMap, HashSet};
use std::io::Write;

use keel_client::schema::event::{DurableEvent, Envelope, EphemeralEvent};
use keel_client::schema::id::MessageId;
use keel_client::schema::types::{Outcome, ToolContent};

/// Writes a session's activity to the terminal: text as it streams, a line per tool
/// call and result. Text whose deltas were missed (a reconnect, or deltas sent while the
/// history was read) is completed from its durable `text.ended`; deltas of a text already
/// ended are ignored.
#[derive(Default)]
pub struct Screen {
    /// Text written so far per (assistant message, part ordinal).
    written: HashMap<(MessageId, u32), String>,
    /// Texts whose `text.ended` has been written.
    ended: HashSet<(MessageId, u32)>,
    /// Tool names by call, to name results.
    tools: HashMap<String, String>,
    /// Whether the cursor is mid-line.
    mid_line: bool,
}

impl Screen {
    pub fn ephemeral(&mut self, event: &EphemeralEvent) {
        if let EphemeralEvent::TextDelta(delta) = event
            && !self
                .ended
                .contains(&(delta.assistant_message_id, delta.ordinal))
        {
            self.written
                .entry((delta.assistant_message_id, delta.ordinal))
                .or_default()
                .push_str(&delta.delta);
            self.write(&delta.delta);
        }
    }

    pub fn durable(&mut self, envelope: &Envelope) {
        match &envelope.event {
            DurableEvent::TextEnded(ended) => {
                self.ended
                    .insert((ended.assistant_message_id, ended.ordinal));
                let written = self
                    .written
                    .remove(&(ended.assistant_message_id, ended.ordinal))
                    .unwrap_or_default();
                match ended.text.strip_prefix(written.as_str()) {
                    Some(rest) => self.write(rest),
                    None => {
                        self.line("");
                        self.write(&ended.text);
                    }
                }
                self.line("");
            }
            DurableEvent::ToolCalled(call) => {
                self.tools
                    .insert(call.call_id.to_string(), call.name.clone());
                self.line(&format!("→ {} {}", call.name, call.input));
            }
            DurableEvent::ToolSuccess(result) => {
                let name = self.tool(&result.call_id.to_string());
                let first = result
                    .content
                    .iter()
                    .find_map(|c| match c {
                        ToolContent::Text { text } => text.lines().next(),
                        ToolContent::Media { .. } => None,
                    })
                    .unwrap_or("");
                self.line(&format!("✓ {name} {first}"));
            }
            DurableEvent::ToolFailed(failed) => {
                let name = self.tool(&failed.call_id.to_string());
                self.line(&format!("✗ {name}: {}", failed.error.message));
            }
            DurableEvent::PermissionRequested(request) => self.line(&format!(
                "? {} wants permission for `{}` (request {})",
                request.tool, request.pattern, request.request_id
            )),
            DurableEvent::QuestionAsked(question) => self.line(&format!(
                "? {} (request {})",
                question.question, question.request_id
            )),
            DurableEvent::RetryScheduled(retry) => self.line(&format!(
                "… retry {} after: {}",
                retry.attempt, retry.error.message
            )),
            DurableEvent::StepFailed(failed) => {
                self.line(&format!("✗ step failed: {}", failed.error.message));
            }
            DurableEvent::StepInterrupted(_) => self.line("✗ interrupted"),
            DurableEvent::ExecutionSettled(settled) => {
                let outcome = match settled.outcome {
                    Outcome::Succeeded => "idle",
                    Outcome::Failed => "idle (the execution failed)",
                    Outcome::Interrupted => "idle (interrupted)",
                    Outcome::Recovered => "recovered; continuing",
                    Outcome::Awaiting => "waiting for your reply",
                };
                self.line(&format!("── {outcome}"));
            }
            _ => {}
        }
    }

    fn tool(&self, call: &str) -> String {
        self.tools
            .get(call)
            .cloned()
            .unwrap_or_else(|| "tool".into())
    }

    fn write(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let mut stdout = std::io::stdout().lock();
        // The terminal is best effort: a closed stdout must not stop the session.
        drop(write!(stdout, "{text}").and_then(|()| stdout.flush()));
        self.mid_line = !text.ends_with('\n');
    }

    /// Ends the current line if one is open, then writes `text` as a line (nothing for "").
    fn line(&mut self, text: &str) {
        if self.mid_line {
            self.write("\n");
        }
        if !text.is_empty() {
            self.write(&format!("{text}\n"));
        }
    }
}
