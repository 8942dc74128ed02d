//! Output truncation, shared by every tool that returns text.
//!
//! Invariants: the kept text is never longer than the limit, is cut at a UTF-8 character
//! boundary, and, when anything was cut, ends with a note saying how many bytes were left
//! out, so the model knows the output is incomplete. Text that fits is returned unchanged.

/// Text cut to a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Truncated {
    /// The kept text, with the truncation note appended when something was cut.
    pub text: String,
    /// Whether anything was cut.
    pub truncated: bool,
}

/// The note appended to cut output.
pub(crate) fn note(omitted_bytes: usize) -> String {
    format!("\n… output truncated: {omitted_bytes} more bytes")
}

/// Cuts `text` to at most `max` bytes (at a character boundary) and notes what was cut.
pub(crate) fn truncate(text: &str, max: usize) -> Truncated {
    if text.len() <= max {
        return Truncated {
            text: text.to_owned(),
            truncated: false,
        };
    }
    let cut = text.floor_char_boundary(max);
    let mut kept = text[..cut].to_owned();
    kept.push_str(&note(text.len() - cut));
    Truncated {
        text: kept,
        truncated: true,
    }
}

/// Output that arrives in pieces (a process's output, search results): keeps the first
/// `max` bytes and only counts the rest, so memory stays bounded however much arrives.
#[derive(Debug)]
pub(crate) struct Capped {
    max: usize,
    kept: Vec<u8>,
    dropped: usize,
}

impl Capped {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            kept: Vec::new(),
            dropped: 0,
        }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        let room = self.max.saturating_sub(self.kept.len());
        let take = room.min(bytes.len());
        self.kept.extend_from_slice(&bytes[..take]);
        self.dropped += bytes.len() - take;
    }

    pub fn push_str(&mut self, text: &str) {
        self.push(text.as_bytes());
    }

    /// Whether everything pushed so far was kept.
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty() && self.dropped == 0
    }

    /// The kept text (invalid UTF-8 replaced), cut and noted as [`truncate`] does.
    pub fn finish(self) -> Truncated {
        let text = String::from_utf8_lossy(&self.kept);
        if self.dropped == 0 {
            // Replacement characters can make lossy text longer than the bytes it came from.
            return truncate(&text, self.max);
        }
        let cut = text.floor_char_boundary(self.max);
        let mut kept = text[..cut].to_owned();
        kept.push_str(&note(text.len() - cut + self.dropped));
        Truncated {
            text: kept,
            truncated: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_that_fits_is_returned_unchanged() {
        let t = truncate("héllo", 6);
        assert_eq!(
            t,
            Truncated {
                text: "héllo".into(),
                truncated: false
            }
        );
    }

    #[test]
    fn cuts_at_a_character_boundary_and_counts_what_was_left_out() {
        // "é" is two bytes; a limit of 2 falls inside it, so only "h" is kept.
        let t = truncate("héllo", 2);
        assert_eq!(
            t,
            Truncated {
                text: "h\n… output truncated: 5 more bytes".into(),
                truncated: true
            }
        );
    }

    #[test]
    fn capped_keeps_the_first_bytes_and_counts_the_rest() {
        let mut c = Capped::new(4);
        c.push_str("ab");
        c.push_str("cdef");
        c.push_str("gh");
        assert_eq!(
            c.finish(),
            Truncated {
                text: "abcd\n… output truncated: 4 more bytes".into(),
                truncated: true
            }
        );
    }

    #[test]
    fn capped_output_that_fits_is_not_noted() {
        let mut c = Capped::new(4);
        c.push_str("abcd");
        assert!(!c.is_empty());
        assert_eq!(
            c.finish(),
            Truncated {
                text: "abcd".into(),
                truncated: false
            }
        );
    }

    proptest::proptest! {
        #[test]
        fn truncated_text_never_exceeds_the_limit_before_the_note(s in ".{0,64}", max in 0usize..80) {
            let t = truncate(&s, max);
            let body = t.text.split("\n… output truncated").next().unwrap_or_default();
            proptest::prop_assert!(body.len() <= max);
            proptest::prop_assert!(s.starts_with(body));
            proptest::prop_assert_eq!(t.truncated, s.len() > max);
        }
    }
}
