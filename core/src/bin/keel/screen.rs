//! How `keel prompt` shows a session's activity on the terminal.

use std::collections::{HashMap, HashSet};
use std::io::Write;

use keel_client::schema::event::{DurableEvent, Envelope, EphemeralEvent};
use keel_client::schema::id::MessageId;
use keel_client::schema::types::{Outcome, ToolContent};

/// A text fragment: (assistant message, ordinal).
type Fragment = (MessageId, u32);

/// Writes a session's activity to the terminal: text as it streams, a line per tool
/// call and result. Text whose deltas were missed (a reconnect, or deltas sent while the
/// history was read) is completed from its durable `text.ended`; deltas of a text already
/// ended are ignored. Deltas may come before their fragment's start and before the end
/// of the fragment before theirs (Keel publishes them without waiting for those commits):
/// each fragment's text starts on a line of its own.
pub struct Screen<W: Write = std::io::Stdout> {
    out: W,
    /// Text written so far per fragment.
    written: HashMap<Fragment, String>,
    /// Texts whose `text.ended` has been written.
    ended: HashSet<Fragment>,
    /// The fragment whose text the current line holds.
    current: Option<Fragment>,
    /// Tool names by call, to name results.
    tools: HashMap<String, String>,
    /// Whether the cursor is mid-line.
    mid_line: bool,
}

impl Default for Screen {
    fn default() -> Self {
        Self::new(std::io::stdout())
    }
}

impl<W: Write> Screen<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            written: HashMap::new(),
            ended: HashSet::new(),
            current: None,
            tools: HashMap::new(),
            mid_line: false,
        }
    }

    pub fn ephemeral(&mut self, event: &EphemeralEvent) {
        if let EphemeralEvent::TextDelta(delta) = event {
            let fragment = (delta.assistant_message_id, delta.ordinal);
            if self.ended.contains(&fragment) {
                return;
            }
            if self.current != Some(fragment) {
                self.line("");
                self.current = Some(fragment);
            }
            self.written
                .entry(fragment)
                .or_default()
                .push_str(&delta.delta);
            self.write(&delta.delta);
        }
    }

    pub fn durable(&mut self, envelope: &Envelope) {
        match &envelope.event {
            DurableEvent::TextEnded(ended) => {
                let fragment = (ended.assistant_message_id, ended.ordinal);
                self.ended.insert(fragment);
                let written = self.written.remove(&fragment).unwrap_or_default();
                let rest = ended.text.strip_prefix(written.as_str());
                let finishing = self.current == Some(fragment);
                match (finishing, rest) {
                    // The current line holds this text: finish it.
                    (true, Some(rest)) => self.write(rest),
                    // Written in full; a later text holds the line.
                    (false, Some("")) => return,
                    // Missed, or cut off by another text: the whole text on lines of its
                    // own.
                    _ => {
                        self.line("");
                        self.write(&ended.text);
                    }
                }
                self.current = None;
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
        // The terminal is best effort: a closed stdout must not stop the session.
        drop(write!(self.out, "{text}").and_then(|()| self.out.flush()));
        self.mid_line = !text.ends_with('\n');
    }

    /// Ends the current line if one is open, then writes `text` as a line (nothing for "").
    fn line(&mut self, text: &str) {
        if self.mid_line {
            self.write("\n");
        }
        if !text.is_empty() {
            // Whatever text the line held is over.
            self.current = None;
            self.write(&format!("{text}\n"));
        }
    }
}

#[cfg(test)]
mod tests {
    use keel_client::schema::event::payload;
    use keel_client::schema::id::{EventId, SessionId};

    use super::*;

    fn delta(message: MessageId, ordinal: u32, text: &str) -> EphemeralEvent {
        EphemeralEvent::TextDelta(payload::TextDelta {
            assistant_message_id: message,
            ordinal,
            delta: text.into(),
        })
    }

    fn ended(message: MessageId, ordinal: u32, text: &str) -> Envelope {
        Envelope {
            id: EventId::new(),
            seq: 1,
            session_id: SessionId::new(),
            time: 0,
            event: DurableEvent::TextEnded(payload::TextEnded {
                assistant_message_id: message,
                ordinal,
                text: text.into(),
            }),
        }
    }

    fn shown(screen: Screen<Vec<u8>>) -> String {
        String::from_utf8(screen.out).unwrap()
    }

    #[test]
    fn each_text_has_its_lines_when_the_next_one_streams_before_its_end() {
        let message = MessageId::new();
        let mut screen = Screen::new(Vec::new());
        screen.ephemeral(&delta(message, 0, "First"));
        screen.ephemeral(&delta(message, 0, " text."));
        screen.ephemeral(&delta(message, 1, "Second"));
        screen.durable(&ended(message, 0, "First text."));
        screen.ephemeral(&delta(message, 1, " one."));
        screen.durable(&ended(message, 1, "Second one."));
        screen.ephemeral(&delta(message, 1, "late"));
        assert_eq!(shown(screen), "First text.\nSecond one.\n");
    }

    #[test]
    fn a_text_whose_deltas_were_missed_is_written_from_its_end() {
        let message = MessageId::new();
        let mut screen = Screen::new(Vec::new());
        screen.ephemeral(&delta(message, 0, "Par"));
        screen.durable(&ended(message, 0, "Partly seen."));
        screen.durable(&ended(message, 1, "Never seen."));
        assert_eq!(shown(screen), "Partly seen.\nNever seen.\n");
    }
}
