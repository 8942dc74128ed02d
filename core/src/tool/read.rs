//! `read`: the lines of a text file, numbered, or an image as media.
//!
//! Invariants: at most `limit` lines (never more than [`Limits::max_lines`]) and at most
//! [`Limits::max_output_bytes`] of text are returned, and when anything is left out the
//! output ends with a note saying where to continue. A long line is cut, not dropped. An
//! image (recognised by its magic bytes) is returned once, base64-encoded, as
//! [`ToolContent::Media`]; the structured output describes it and never holds its bytes.
//! A file is read as a stream, so a huge file costs no more memory than what is returned.
//!
//! [`Limits::max_lines`]: super::Limits::max_lines
//! [`Limits::max_output_bytes`]: super::Limits::max_output_bytes

use std::io::{self, BufRead, BufReader, Read as _};
use std::path::Path;

use base64::Engine as _;
use keel_schema::types::{Effect, ToolContent};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use super::path::{self, Beneath, Resolved};
use super::{Context, Error, Output, Run, Tool, blocking, input, text, truncate};

/// Bytes of a single line kept; the rest of the line is replaced by a note.
const MAX_LINE_BYTES: usize = 2000;
/// Images larger than this are refused: they would bloat the event log and the request.
const MAX_MEDIA_BYTES: u64 = 10 * 1024 * 1024;
/// How much of a file is looked at to tell an image or a binary file from text.
const SNIFF_BYTES: usize = 8192;

/// The `read` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct Read;

/// Input of `read`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// The file, relative to the session directory.
    pub path: String,
    /// The first line to return, 1-based (default 1).
    #[serde(default)]
    #[schemars(range(min = 1))]
    pub offset: Option<usize>,
    /// How many lines to return (default and maximum: the configured line limit).
    #[serde(default)]
    #[schemars(range(min = 1))]
    pub limit: Option<usize>,
}

impl Tool for Read {
    fn name(&self) -> &'static str {
        "read"
    }

    fn description(&self) -> &'static str {
        "Read a text file as numbered lines (`offset` is the 1-based first line, `limit` the \
         number of lines), or an image (png, jpeg, gif, webp) as media."
    }

    fn effect(&self) -> Effect {
        Effect::Read
    }

    fn input_schema(&self) -> Value {
        input::schema::<Input>()
    }

    fn permission_pattern(&self, input: &Value, root: &Path) -> String {
        path::permission_path(root, input::field(input, "path", ""))
    }

    fn run<'a>(&'a self, input: Value, context: &'a Context) -> Run<'a> {
        Box::pin(async move {
            let input: Input = input::parse(input)?;
            let offset = input.offset.unwrap_or(1);
            if offset == 0 {
                return Err(Error::InvalidInput(
                    "`offset` is 1-based; use 1 for the first line".into(),
                ));
            }
            let max_lines = context.limits.max_lines;
            let limit = match input.limit {
                Some(0) => return Err(Error::InvalidInput("`limit` must be at least 1".into())),
                Some(limit) => limit.min(max_lines),
                None => max_lines,
            };
            let file = path::resolve(&context.directory, &input.path)?;
            let window = Window {
                offset,
                limit,
                max_bytes: context.limits.max_output_bytes,
            };
            let root = context.directory.clone();
            blocking(move || read(&Beneath::new(&root)?, &file, window)).await
        })
    }
}

/// Which lines to return and how much text at most.
#[derive(Debug, Clone, Copy)]
struct Window {
    offset: usize,
    limit: usize,
    max_bytes: usize,
}

fn read(beneath: &Beneath, file: &Resolved, window: Window) -> Result<Output, Error> {
    let shown = file.shown.as_str();
    let io = |e: io::Error| Error::from_io(shown, &e);
    let handle = beneath
        .open(&file.real, path::READ, 0)
        .map_err(|e| path::failure(shown, &e))?;
    let meta = handle.metadata().map_err(io)?;
    if meta.is_dir() {
        return Err(Error::Io(format!(
            "`{shown}` is a directory; use `list` to see its entries"
        )));
    }
    if !meta.is_file() {
        return Err(Error::Io(format!("`{shown}` is not a regular file")));
    }
    let mut reader = BufReader::with_capacity(SNIFF_BYTES, handle);
    let head = reader.fill_buf().map_err(io)?;
    if let Some(mime) = image_mime(head) {
        return media(reader, shown, mime, meta.len());
    }
    if head.contains(&0) {
        return Err(Error::Io(format!(
            "`{shown}` is a binary file (not text, and not a png, jpeg, gif or webp image); \
             use `bash` to inspect it"
        )));
    }
    lines(&mut reader, shown, window).map_err(io)
}

/// The image type of a file starting with `head`, by magic bytes.
fn image_mime(head: &[u8]) -> Option<&'static str> {
    if head.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if head.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some("image/jpeg")
    } else if head.starts_with(b"GIF87a") || head.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if head.len() >= 12 && head.starts_with(b"RIFF") && &head[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// The image `file` holds (nothing of it consumed yet), whole.
fn media(file: impl io::Read, shown: &str, mime: &str, size: u64) -> Result<Output, Error> {
    let too_large = |size: u64| {
        Error::Io(format!(
            "`{shown}` is a {mime} image of {size} bytes, larger than the {MAX_MEDIA_BYTES} \
             bytes `read` returns"
        ))
    };
    if size > MAX_MEDIA_BYTES {
        return Err(too_large(size));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    // One byte past the limit tells a file that grew since it was measured.
    file.take(MAX_MEDIA_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::from_io(shown, &e))?;
    if bytes.len() as u64 > MAX_MEDIA_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(Output {
        structured: json!({ "path": shown, "mime": mime, "bytes": bytes.len() }),
        content: vec![
            ToolContent::Text {
                text: format!("`{shown}`: {mime} image, {} bytes", bytes.len()),
            },
            ToolContent::Media {
                mime: mime.to_owned(),
                data: base64::engine::general_purpose::STANDARD.encode(&bytes),
            },
        ],
    })
}

fn lines(reader: &mut impl BufRead, shown: &str, window: Window) -> io::Result<Output> {
    let mut out = String::new();
    let mut number = 0;
    let mut returned = 0;
    let mut line = Vec::new();
    // Where the model should continue, if something was left out, and whether the cut was
    // for size (rather than the line limit).
    let mut cut: Option<(usize, bool)> = None;
    while let Some(full_len) = next_line(reader, MAX_LINE_BYTES, &mut line)? {
        number += 1;
        if number < window.offset {
            continue;
        }
        if returned == window.limit {
            cut = Some((number, false));
            break;
        }
        let mut entry = format!("{number}: {}", String::from_utf8_lossy(&line));
        if full_len > line.len() {
            entry.push_str(&format!(
                " … (line cut: {} more bytes)",
                full_len - line.len()
            ));
        }
        entry.push('\n');
        if out.len() + entry.len() > window.max_bytes {
            if returned == 0 {
                // Not even one line fits: return what fits of it.
                out = truncate::truncate(&entry, window.max_bytes).text;
                returned = 1;
                cut = Some((number + 1, true));
            } else {
                cut = Some((number, true));
            }
            break;
        }
        out.push_str(&entry);
        returned += 1;
    }
    if returned == 0 && cut.is_none() {
        let message = if number == 0 {
            format!("(`{shown}` is empty)")
        } else {
            format!(
                "(`{shown}` has {number} lines; offset {} is past the end)",
                window.offset
            )
        };
        return Ok(Output {
            structured: json!({ "path": shown, "offset": window.offset, "lines": 0, "more": false, "truncated": false }),
            content: text(message),
        });
    }
    let truncated = matches!(cut, Some((_, true)));
    if let Some((next, for_size)) = cut {
        let why = if for_size {
            "output truncated"
        } else {
            "more lines follow"
        };
        if !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&format!("… {why}; continue with offset={next}"));
    } else if out.ends_with('\n') {
        out.pop();
    }
    Ok(Output {
        structured: json!({
            "path": shown,
            "offset": window.offset,
            "lines": returned,
            "more": cut.is_some(),
            "truncated": truncated,
        }),
        content: text(out),
    })
}

/// Reads the next line (without its `\n` or `\r\n`) into `line`, keeping at most `keep`
/// bytes of it; returns the line's full length, or `None` at the end of the input.
fn next_line(
    reader: &mut impl BufRead,
    keep: usize,
    line: &mut Vec<u8>,
) -> io::Result<Option<usize>> {
    line.clear();
    let mut full_len = 0;
    let mut any = false;
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            break;
        }
        any = true;
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], true),
            None => (buf, false),
        };
        let room = keep.saturating_sub(line.len());
        line.extend_from_slice(&chunk[..room.min(chunk.len())]);
        full_len += chunk.len();
        let used = chunk.len() + usize::from(done);
        reader.consume(used);
        if done {
            break;
        }
    }
    if !any {
        return Ok(None);
    }
    if line.last() == Some(&b'\r') && line.len() == full_len {
        line.pop();
        full_len -= 1;
    }
    Ok(Some(full_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(text: &str, window: Window) -> String {
        let mut reader = io::Cursor::new(text.as_bytes().to_vec());
        let out = lines(&mut reader, "f", window).expect("in memory");
        match out.content.as_slice() {
            [ToolContent::Text { text }] => text.clone(),
            other => panic!("unexpected content {other:?}"),
        }
    }

    const ALL: Window = Window {
        offset: 1,
        limit: 100,
        max_bytes: 10_000,
    };

    #[test]
    fn numbers_lines_from_one_and_strips_line_endings() {
        assert_eq!(read_all("a\r\nb\nc", ALL), "1: a\n2: b\n3: c");
        assert_eq!(read_all("a\n\n", ALL), "1: a\n2: ");
    }

    #[test]
    fn offset_and_limit_select_a_window_and_say_where_to_continue() {
        let window = Window {
            offset: 2,
            limit: 2,
            ..ALL
        };
        assert_eq!(
            read_all("a\nb\nc\nd\n", window),
            "2: b\n3: c\n… more lines follow; continue with offset=4"
        );
    }

    #[test]
    fn a_long_line_is_cut_with_a_note() {
        let long = "x".repeat(MAX_LINE_BYTES + 5);
        let out = read_all(&long, ALL);
        assert_eq!(
            out,
            format!(
                "1: {} … (line cut: 5 more bytes)",
                "x".repeat(MAX_LINE_BYTES)
            )
        );
    }

    #[test]
    fn output_is_cut_at_a_line_when_over_the_byte_limit() {
        let window = Window {
            max_bytes: 14,
            ..ALL
        };
        assert_eq!(
            read_all("abc\ndef\nghi\n", window),
            "1: abc\n2: def\n… output truncated; continue with offset=3"
        );
    }

    #[test]
    fn recognises_images_by_magic_bytes() {
        assert_eq!(image_mime(b"\x89PNG\r\n\x1a\nrest"), Some("image/png"));
        assert_eq!(image_mime(&[0xFF, 0xD8, 0xFF, 0xE0]), Some("image/jpeg"));
        assert_eq!(image_mime(b"GIF89a..."), Some("image/gif"));
        assert_eq!(image_mime(b"RIFF\0\0\0\0WEBPVP8 "), Some("image/webp"));
        assert_eq!(image_mime(b"RIFF\0\0\0\0WAVEfmt "), None);
        assert_eq!(image_mime(b"plain text"), None);
    }
}
