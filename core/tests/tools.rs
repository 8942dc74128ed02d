//! The built-in tools, run through [`builtins`] against real temporary directories.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use keel_core::tool::{Context, Error, Limits, Output, Tool, builtins};
use keel_schema::id::{CallId, SessionId};
use keel_schema::types::{Effect, ToolContent};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A 1×1 transparent PNG.
const PIXEL_PNG: &[u8] = &[
    0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1F, 0x15, 0xC4,
    0x89, 0x00, 0x00, 0x00, 0x0A, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9C, 0x63, 0x00, 0x01, 0x00, 0x00,
    0x05, 0x00, 0x01, 0x0D, 0x0A, 0x2D, 0xB4, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4E, 0x44, 0xAE,
    0x42, 0x60, 0x82,
];

/// A session directory (`<tmp>/session`) with a sibling `<tmp>/outside` holding
/// `secret.txt`, so `../outside/secret.txt` names a real file outside.
struct Session {
    _tmp: TempDir,
    root: PathBuf,
    outside: PathBuf,
    context: Context,
}

impl Session {
    fn new() -> Self {
        Self::with_limits(Limits::default())
    }

    fn with_limits(limits: Limits) -> Self {
        let tmp = tempfile::tempdir().expect("temp dir");
        let base = tmp.path().canonicalize().expect("canonical temp dir");
        let root = base.join("session");
        let outside = base.join("outside");
        std::fs::create_dir_all(&root).expect("session dir");
        std::fs::create_dir_all(outside.join("dir")).expect("outside dir");
        std::fs::write(outside.join("secret.txt"), "secret needle\n").expect("secret");
        std::fs::write(outside.join("dir/deep.txt"), "deep needle\n").expect("deep secret");
        let context = Context {
            directory: root.clone(),
            cancel: CancellationToken::new(),
            limits,
            progress: None,
            call: None,
        };
        Self {
            _tmp: tmp,
            root,
            outside,
            context,
        }
    }

    fn file(&self, relative: &str, content: impl AsRef<[u8]>) {
        let path = self.root.join(relative);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("parent dirs");
        }
        std::fs::write(path, content).expect("write fixture");
    }

    fn link(&self, relative: &str, target: impl AsRef<Path>) {
        symlink(target, self.root.join(relative)).expect("symlink");
    }

    async fn call(&self, tool: &str, input: Value) -> Result<Output, Error> {
        call_with(&self.context, tool, input).await
    }
}

fn tool(name: &str) -> Arc<dyn Tool> {
    builtins().get(name).cloned().expect("a built-in tool")
}

async fn call_with(context: &Context, name: &str, input: Value) -> Result<Output, Error> {
    tool(name).run(input, context).await
}

/// The text the model sees.
fn text(output: &Output) -> String {
    output
        .content
        .iter()
        .map(|c| match c {
            ToolContent::Text { text } => text.as_str(),
            ToolContent::Media { .. } => "<media>",
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn escape(path: &str) -> Result<Output, Error> {
    Err(Error::PathEscape(path.to_owned()))
}

// --- confinement -----------------------------------------------------------------------

#[tokio::test]
async fn paths_that_leave_the_session_directory_are_refused_by_every_file_tool() {
    let s = Session::new();
    s.file("a/inside.txt", "inside\n");
    let secret = s.outside.join("secret.txt");
    let absolute = secret.to_str().expect("utf-8 path").to_owned();
    for path in [
        "../outside/secret.txt",
        "a/../../outside/secret.txt",
        "./../outside/secret.txt",
        absolute.as_str(),
    ] {
        let calls = [
            ("read", json!({ "path": path })),
            ("write", json!({ "path": path, "content": "x" })),
            ("edit", json!({ "path": path, "old": "secret", "new": "x" })),
            ("list", json!({ "path": path })),
            ("grep", json!({ "pattern": "needle", "path": path })),
        ];
        for (name, input) in calls {
            assert_eq!(s.call(name, input).await, escape(path), "{name} {path}");
        }
    }
    assert_eq!(s.call("list", json!({ "path": ".." })).await, escape(".."));
    assert_eq!(
        std::fs::read_to_string(&secret).expect("secret"),
        "secret needle\n"
    );
}

#[tokio::test]
async fn symlinks_leading_outside_are_refused_for_files_and_directories() {
    let s = Session::new();
    s.link("secret-link", s.outside.join("secret.txt"));
    s.link("dir-link", s.outside.join("dir"));
    s.link("relative-link", "../outside/secret.txt");
    s.link("dangling-link", s.outside.join("new.txt"));
    for path in [
        "secret-link",
        "relative-link",
        "dir-link",
        "dir-link/deep.txt",
        "dangling-link",
    ] {
        let calls = [
            ("read", json!({ "path": path })),
            ("write", json!({ "path": path, "content": "x" })),
            ("edit", json!({ "path": path, "old": "needle", "new": "x" })),
            ("list", json!({ "path": path })),
            ("grep", json!({ "pattern": "needle", "path": path })),
        ];
        for (name, input) in calls {
            assert_eq!(s.call(name, input).await, escape(path), "{name} {path}");
        }
    }
    assert!(!s.outside.join("new.txt").exists());
    assert_eq!(
        std::fs::read_to_string(s.outside.join("secret.txt")).expect("secret"),
        "secret needle\n"
    );
}

#[tokio::test]
async fn writing_through_a_symlinked_parent_directory_that_leads_outside_is_refused() {
    let s = Session::new();
    s.link("out", &s.outside);
    assert_eq!(
        s.call(
            "write",
            json!({ "path": "out/created/new.txt", "content": "x" })
        )
        .await,
        escape("out/created/new.txt")
    );
    assert!(!s.outside.join("created").exists());
}

#[tokio::test]
async fn a_symlink_inside_that_points_inside_is_followed() {
    let s = Session::new();
    s.file("real/file.txt", "hello\n");
    s.link("file-link", "real/file.txt");
    s.link("dir-link", s.root.join("real"));
    let read = s
        .call("read", json!({ "path": "file-link" }))
        .await
        .expect("read through link");
    assert_eq!(text(&read), "1: hello");
    s.call(
        "write",
        json!({ "path": "dir-link/new.txt", "content": "new" }),
    )
    .await
    .expect("write through link");
    assert_eq!(
        std::fs::read_to_string(s.root.join("real/new.txt")).expect("written"),
        "new"
    );
    let listed = s.call("list", json!({})).await.expect("list");
    assert_eq!(text(&listed), "dir-link/\nfile-link\nreal/");
}

#[tokio::test]
async fn absolute_paths_inside_the_session_directory_are_accepted() {
    let s = Session::new();
    s.file("notes.txt", "one\n");
    let absolute = s.root.join("notes.txt");
    let read = s
        .call(
            "read",
            json!({ "path": absolute.to_str().expect("utf-8 path") }),
        )
        .await
        .expect("read");
    assert_eq!(
        read.structured,
        json!({ "path": "notes.txt", "offset": 1, "lines": 1, "more": false, "truncated": false })
    );
}

#[tokio::test]
async fn glob_grep_and_list_do_not_report_files_outside_through_symlinks() {
    let s = Session::new();
    s.file("mine.txt", "my needle\n");
    s.link("secret-link.txt", s.outside.join("secret.txt"));
    s.link("dir-link", s.outside.join("dir"));
    s.link("dangling.txt", s.outside.join("missing.txt"));

    let listed = s.call("list", json!({})).await.expect("list");
    assert_eq!(text(&listed), "mine.txt");
    let globbed = s
        .call("glob", json!({ "pattern": "*.txt" }))
        .await
        .expect("glob");
    assert_eq!(text(&globbed), "mine.txt");
    let grepped = s
        .call("grep", json!({ "pattern": "needle" }))
        .await
        .expect("grep");
    assert_eq!(text(&grepped), "mine.txt:1: my needle");
}

// --- read ------------------------------------------------------------------------------

#[tokio::test]
async fn read_numbers_lines_and_honours_offset_and_limit() {
    let s = Session::new();
    s.file("five.txt", "a\nb\nc\nd\ne\n");
    let all = s
        .call("read", json!({ "path": "five.txt" }))
        .await
        .expect("read");
    assert_eq!(text(&all), "1: a\n2: b\n3: c\n4: d\n5: e");
    let window = s
        .call(
            "read",
            json!({ "path": "five.txt", "offset": 2, "limit": 2 }),
        )
        .await
        .expect("read window");
    assert_eq!(
        window,
        Output {
            structured: json!({ "path": "five.txt", "offset": 2, "lines": 2, "more": true, "truncated": false }),
            content: vec![ToolContent::Text {
                text: "2: b\n3: c\n… more lines follow; continue with offset=4".into()
            }],
        }
    );
}

#[tokio::test]
async fn read_returns_at_most_max_lines_whatever_limit_is_asked() {
    let s = Session::with_limits(Limits {
        max_lines: 2,
        ..Limits::default()
    });
    s.file("five.txt", "a\nb\nc\nd\ne\n");
    let read = s
        .call("read", json!({ "path": "five.txt", "limit": 100 }))
        .await
        .expect("read");
    assert_eq!(
        text(&read),
        "1: a\n2: b\n… more lines follow; continue with offset=3"
    );
}

#[tokio::test]
async fn read_of_a_missing_file_is_not_found() {
    let s = Session::new();
    let err = s
        .call("read", json!({ "path": "nope.txt" }))
        .await
        .expect_err("missing");
    assert_eq!(err, Error::NotFound("nope.txt".into()));
    assert_eq!(err.info().kind, "tool.not-found");
}

#[tokio::test]
async fn read_of_a_directory_is_an_error_that_suggests_list() {
    let s = Session::new();
    s.file("src/main.rs", "fn main() {}\n");
    assert_eq!(
        s.call("read", json!({ "path": "src" })).await,
        Err(Error::Io(
            "`src` is a directory; use `list` to see its entries".into()
        ))
    );
}

#[tokio::test]
async fn read_of_a_binary_file_that_is_not_an_image_is_a_clear_error() {
    let s = Session::new();
    s.file("blob.bin", [0u8, 1, 2, 3, 0, 255]);
    let err = s
        .call("read", json!({ "path": "blob.bin" }))
        .await
        .expect_err("binary");
    assert_eq!(
        err,
        Error::Io(
            "`blob.bin` is a binary file (not text, and not a png, jpeg, gif or webp image); \
             use `bash` to inspect it"
                .into()
        )
    );
}

#[tokio::test]
async fn read_returns_an_image_once_as_media_and_never_in_structured_output() {
    let s = Session::new();
    s.file("pixel.dat", PIXEL_PNG);
    let read = s
        .call("read", json!({ "path": "pixel.dat" }))
        .await
        .expect("read image");
    let media: Vec<_> = read
        .content
        .iter()
        .filter_map(|c| match c {
            ToolContent::Media { mime, data } => Some((mime.clone(), data.clone())),
            ToolContent::Text { .. } => None,
        })
        .collect();
    assert_eq!(media.len(), 1, "exactly one media part");
    let (mime, data) = &media[0];
    assert_eq!(mime, "image/png");
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(data)
        .expect("valid base64");
    assert_eq!(decoded, PIXEL_PNG);
    assert_eq!(
        read.structured,
        json!({ "path": "pixel.dat", "mime": "image/png", "bytes": PIXEL_PNG.len() })
    );
    assert!(!read.structured.to_string().contains(data.as_str()));
    let texts: Vec<_> = read
        .content
        .iter()
        .filter_map(|c| match c {
            ToolContent::Text { text } => Some(text.as_str()),
            ToolContent::Media { .. } => None,
        })
        .collect();
    assert!(texts.iter().all(|t| !t.contains(data.as_str())));
}

#[tokio::test]
async fn read_detects_images_by_content_not_by_extension() {
    let s = Session::new();
    s.file("fake.png", "not an image\n");
    let read = s
        .call("read", json!({ "path": "fake.png" }))
        .await
        .expect("read text");
    assert_eq!(text(&read), "1: not an image");
}

// --- write and edit --------------------------------------------------------------------

#[tokio::test]
async fn write_creates_parent_directories_and_says_whether_it_created_the_file() {
    let s = Session::new();
    let first = s
        .call("write", json!({ "path": "a/b/c.txt", "content": "héllo" }))
        .await
        .expect("create");
    assert_eq!(
        first.structured,
        json!({ "path": "a/b/c.txt", "bytes": 6, "created": true })
    );
    let second = s
        .call("write", json!({ "path": "a/b/c.txt", "content": "bye" }))
        .await
        .expect("replace");
    assert_eq!(
        second.structured,
        json!({ "path": "a/b/c.txt", "bytes": 3, "created": false })
    );
    assert_eq!(
        std::fs::read_to_string(s.root.join("a/b/c.txt")).expect("written"),
        "bye"
    );
}

#[tokio::test]
async fn write_to_a_directory_is_refused() {
    let s = Session::new();
    std::fs::create_dir(s.root.join("d")).expect("dir");
    assert_eq!(
        s.call("write", json!({ "path": "d", "content": "x" }))
            .await,
        Err(Error::Io("`d` is a directory".into()))
    );
}

#[tokio::test]
async fn edit_replaces_the_one_occurrence_of_old() {
    let s = Session::new();
    s.file("f.rs", "fn a() {}\nfn b() {}\n");
    let edited = s
        .call(
            "edit",
            json!({ "path": "f.rs", "old": "fn b() {}", "new": "fn c() {}" }),
        )
        .await
        .expect("edit");
    assert_eq!(
        edited.structured,
        json!({ "path": "f.rs", "replacements": 1 })
    );
    assert_eq!(
        std::fs::read_to_string(s.root.join("f.rs")).expect("edited"),
        "fn a() {}\nfn c() {}\n"
    );
}

#[tokio::test]
async fn edit_fails_with_the_match_count_when_old_is_missing_or_ambiguous() {
    let s = Session::new();
    s.file("f.txt", "x = 1\nx = 1\n");
    let missing = s
        .call(
            "edit",
            json!({ "path": "f.txt", "old": "y = 1", "new": "y = 2" }),
        )
        .await
        .expect_err("no match");
    assert_eq!(
        missing,
        Error::EditMatch(
            "`old` was found 0 times in `f.txt`, it must be found exactly once: it must match \
             exactly, whitespace and indentation included; read the file first"
                .into()
        )
    );
    assert_eq!(missing.info().kind, "tool.edit-match");
    let ambiguous = s
        .call(
            "edit",
            json!({ "path": "f.txt", "old": "x = 1", "new": "x = 2" }),
        )
        .await
        .expect_err("two matches");
    assert_eq!(
        ambiguous,
        Error::EditMatch(
            "`old` was found 2 times in `f.txt`, it must be found exactly once: include more \
             surrounding lines so it matches exactly once"
                .into()
        )
    );
    assert_eq!(
        std::fs::read_to_string(s.root.join("f.txt")).expect("untouched"),
        "x = 1\nx = 1\n"
    );
}

#[tokio::test]
async fn edit_of_a_missing_file_is_not_found() {
    let s = Session::new();
    assert_eq!(
        s.call("edit", json!({ "path": "nope", "old": "a", "new": "b" }))
            .await,
        Err(Error::NotFound("nope".into()))
    );
}

// --- list, glob, grep ------------------------------------------------------------------

#[tokio::test]
async fn list_sorts_entries_and_marks_directories() {
    let s = Session::new();
    s.file("b.txt", "");
    s.file("a/x.txt", "");
    s.file(".hidden", "");
    let listed = s.call("list", json!({})).await.expect("list");
    assert_eq!(
        listed,
        Output {
            structured: json!({ "path": ".", "entries": 3, "truncated": false }),
            content: vec![ToolContent::Text {
                text: ".hidden\na/\nb.txt".into()
            }],
        }
    );
    let sub = s
        .call("list", json!({ "path": "a" }))
        .await
        .expect("list a");
    assert_eq!(text(&sub), "x.txt");
    assert_eq!(
        s.call("list", json!({ "path": "b.txt" })).await,
        Err(Error::Io(
            "`b.txt` is not a directory; use `read` to see a file".into()
        ))
    );
}

#[tokio::test]
async fn glob_finds_matching_files_sorted_and_respects_gitignore() {
    let s = Session::new();
    s.file(".gitignore", "target/\n*.log\n");
    s.file("src/main.rs", "");
    s.file("src/tool/a.rs", "");
    s.file("build.rs", "");
    s.file("target/debug/gen.rs", "");
    s.file("debug.log", "");
    s.file(".git/config.rs", "");
    let all_rs = s
        .call("glob", json!({ "pattern": "*.rs" }))
        .await
        .expect("glob");
    assert_eq!(
        all_rs,
        Output {
            structured: json!({ "pattern": "*.rs", "files": 3, "truncated": false }),
            content: vec![ToolContent::Text {
                text: "build.rs\nsrc/main.rs\nsrc/tool/a.rs".into()
            }],
        }
    );
    let anchored = s
        .call("glob", json!({ "pattern": "src/*.rs" }))
        .await
        .expect("glob");
    assert_eq!(text(&anchored), "src/main.rs");
    let none = s
        .call("glob", json!({ "pattern": "*.log" }))
        .await
        .expect("glob");
    assert_eq!(text(&none), "(no files match `*.log`)");
    assert!(matches!(
        s.call("glob", json!({ "pattern": "!*.rs" })).await,
        Err(Error::InvalidInput(_))
    ));
}

#[tokio::test]
async fn grep_reports_file_line_and_text_for_each_match() {
    let s = Session::new();
    s.file("a.txt", "alpha\nneedle one\nbeta\n");
    s.file("sub/b.txt", "needle two\r\n");
    s.file("bin.dat", b"needle\0binary");
    let found = s
        .call("grep", json!({ "pattern": "needle \\w+" }))
        .await
        .expect("grep");
    assert_eq!(
        found,
        Output {
            structured: json!({ "pattern": "needle \\w+", "matches": 2, "files": 2, "truncated": false }),
            content: vec![ToolContent::Text {
                text: "a.txt:2: needle one\nsub/b.txt:1: needle two".into()
            }],
        }
    );
    let under = s
        .call("grep", json!({ "pattern": "needle", "path": "sub" }))
        .await
        .expect("grep under sub");
    assert_eq!(text(&under), "sub/b.txt:1: needle two");
    let one_file = s
        .call("grep", json!({ "pattern": "a", "path": "a.txt" }))
        .await
        .expect("grep a file");
    assert_eq!(text(&one_file), "a.txt:1: alpha\na.txt:3: beta");
}

#[tokio::test]
async fn grep_with_an_invalid_regex_or_a_missing_path_fails() {
    let s = Session::new();
    assert!(matches!(
        s.call("grep", json!({ "pattern": "(" })).await,
        Err(Error::InvalidInput(m)) if m.starts_with("invalid regular expression")
    ));
    assert_eq!(
        s.call("grep", json!({ "pattern": "x", "path": "nope" }))
            .await,
        Err(Error::NotFound("nope".into()))
    );
}

// --- input, schema, truncation ---------------------------------------------------------

#[tokio::test]
async fn unknown_input_fields_are_invalid_input_for_every_tool() {
    let s = Session::new();
    let calls = [
        ("read", json!({ "path": "x", "bogus": 1 })),
        ("write", json!({ "path": "x", "content": "", "bogus": 1 })),
        (
            "edit",
            json!({ "path": "x", "old": "a", "new": "b", "bogus": 1 }),
        ),
        ("list", json!({ "bogus": 1 })),
        ("glob", json!({ "pattern": "*", "bogus": 1 })),
        ("grep", json!({ "pattern": "x", "bogus": 1 })),
        ("bash", json!({ "command": "true", "bogus": 1 })),
    ];
    for (name, input) in calls {
        let err = s.call(name, input).await.expect_err(name);
        assert!(
            matches!(&err, Error::InvalidInput(m) if m.starts_with("unknown field `bogus`")),
            "{name}: {err:?}"
        );
        assert_eq!(err.info().kind, "tool.input");
    }
    assert!(!s.root.join("x").exists());
}

#[test]
fn builtins_are_the_seven_spec_tools_with_their_effects_and_schemas() {
    let tools: Vec<_> = builtins().iter().map(|t| (t.name(), t.effect())).collect();
    assert_eq!(
        tools,
        vec![
            ("read", Effect::Read),
            ("write", Effect::Write),
            ("edit", Effect::Write),
            ("list", Effect::Read),
            ("glob", Effect::Read),
            ("grep", Effect::Read),
            ("bash", Effect::Write),
        ]
    );
    for t in builtins().iter() {
        let schema = t.input_schema();
        assert_eq!(schema["type"], "object", "{}", t.name());
        assert_eq!(schema["additionalProperties"], false, "{}", t.name());
        assert_eq!(
            schema["$schema"],
            "https://json-schema.org/draft/2020-12/schema",
            "{}",
            t.name()
        );
        assert!(!t.description().is_empty());
    }
    let read = tool("read").input_schema();
    assert_eq!(read["required"], json!(["path"]));
}

#[test]
fn permission_patterns_are_the_command_the_path_or_the_pattern() {
    let cases = [
        ("bash", json!({ "command": "cargo test" }), "cargo test"),
        ("read", json!({ "path": "src/a.rs" }), "src/a.rs"),
        ("write", json!({ "path": "b", "content": "" }), "b"),
        ("edit", json!({ "path": "c", "old": "", "new": "" }), "c"),
        ("list", json!({}), "."),
        ("glob", json!({ "pattern": "*.rs" }), "*.rs"),
        ("grep", json!({ "pattern": "fn main" }), "fn main"),
    ];
    for (name, input, pattern) in cases {
        assert_eq!(tool(name).permission_pattern(&input), pattern, "{name}");
    }
}

#[tokio::test]
async fn output_over_the_limit_is_cut_with_a_note_and_flagged_truncated() {
    let s = Session::with_limits(Limits {
        max_output_bytes: 20,
        ..Limits::default()
    });
    for i in 0..10 {
        s.file(&format!("file-{i}.txt"), "");
    }
    let globbed = s
        .call("glob", json!({ "pattern": "*.txt" }))
        .await
        .expect("glob");
    assert_eq!(
        globbed,
        Output {
            structured: json!({ "pattern": "*.txt", "files": 10, "truncated": true }),
            content: vec![ToolContent::Text {
                text: "file-0.txt\nfile-1.tx\n… output truncated: 89 more bytes".into()
            }],
        }
    );
}

// --- bash ------------------------------------------------------------------------------

#[tokio::test]
async fn bash_runs_in_the_session_directory_with_empty_stdin_and_interleaved_output() {
    let s = Session::new();
    s.file("here.txt", "");
    let ran = s
        .call(
            "bash",
            json!({ "command": "ls; echo to-stderr >&2; echo to-stdout; cat" }),
        )
        .await
        .expect("bash");
    assert_eq!(
        ran,
        Output {
            structured: json!({
                "exit_code": 0,
                "signal": null,
                "output": "here.txt\nto-stderr\nto-stdout\n",
                "truncated": false,
            }),
            content: vec![ToolContent::Text {
                text: "here.txt\nto-stderr\nto-stdout\n".into()
            }],
        }
    );
}

#[tokio::test]
async fn bash_tells_the_command_its_session_and_call_when_a_session_runs_it() {
    let mut s = Session::new();
    let command = json!({ "command": "echo \"[$KEEL_SESSION_ID] [$KEEL_CALL_ID]\"" });
    let alone = s.call("bash", command.clone()).await.expect("bash");
    assert_eq!(text(&alone), "[] []\n");
    let (session, call) = (SessionId::new(), CallId::new());
    s.context.call = Some((session, call));
    let ran = s.call("bash", command).await.expect("bash");
    assert_eq!(text(&ran), format!("[{session}] [{call}]\n"));
}

#[tokio::test]
async fn bash_reports_a_non_zero_exit_as_a_successful_call_stating_the_code() {
    let s = Session::new();
    let ran = s
        .call("bash", json!({ "command": "echo oops; exit 2" }))
        .await
        .expect("a non-zero exit is not a tool failure");
    assert_eq!(text(&ran), "oops\nexit code 2");
    assert_eq!(ran.structured["exit_code"], 2);
    let silent = s
        .call("bash", json!({ "command": "false" }))
        .await
        .expect("bash");
    assert_eq!(text(&silent), "exit code 1");
    let quiet = s
        .call("bash", json!({ "command": "true" }))
        .await
        .expect("bash");
    assert_eq!(text(&quiet), "(no output)");
}

#[tokio::test]
async fn bash_output_is_capped_at_max_output_bytes() {
    let s = Session::with_limits(Limits {
        max_output_bytes: 1000,
        ..Limits::default()
    });
    let ran = s
        .call(
            "bash",
            json!({ "command": "head -c 100000 /dev/zero | tr '\\0' a" }),
        )
        .await
        .expect("bash");
    let expected = format!("{}\n… output truncated: 99000 more bytes", "a".repeat(1000));
    assert_eq!(
        ran.structured,
        json!({ "exit_code": 0, "signal": null, "output": expected, "truncated": true })
    );
    assert_eq!(text(&ran), expected);
}

#[tokio::test]
async fn bash_offers_its_output_as_progress() {
    let (tx, mut rx) = mpsc::channel(16);
    let mut s = Session::new();
    s.context.progress = Some(tx);
    s.call("bash", json!({ "command": "echo hello" }))
        .await
        .expect("bash");
    assert_eq!(rx.recv().await, Some(json!({ "output": "hello\n" })));
}

#[tokio::test]
async fn bash_timeout_kills_the_whole_process_group_including_background_children() {
    let (tx, mut rx) = mpsc::channel(16);
    let mut s = Session::new();
    s.context.progress = Some(tx);
    // Generous enough for bash to start and print its pids before the timeout fires.
    let ran = s
        .call(
            "bash",
            json!({ "command": "sleep 100 & echo $$ $!; sleep 100; wait", "timeout_ms": 2000 }),
        )
        .await;
    assert_eq!(ran, Err(Error::Timeout(2000)));
    assert_eq!(ran.expect_err("timed out").info().kind, "tool.timeout");
    let printed = rx
        .try_recv()
        .expect("the pids were printed before the timeout");
    for pid in pids(&printed) {
        assert_process_ends(pid).await;
    }
}

#[tokio::test]
async fn bash_timeout_is_clamped_to_max_timeout() {
    let s = Session::with_limits(Limits {
        max_timeout_ms: 500,
        ..Limits::default()
    });
    let ran = s
        .call(
            "bash",
            json!({ "command": "sleep 100", "timeout_ms": 10_000_000 }),
        )
        .await;
    assert_eq!(ran, Err(Error::Timeout(500)));
}

#[tokio::test]
async fn bash_cancellation_kills_the_whole_process_group_and_is_interrupted() {
    let (tx, mut rx) = mpsc::channel(16);
    let mut s = Session::new();
    s.context.progress = Some(tx);
    let context = s.context.clone();
    let run = tokio::spawn(async move {
        call_with(
            &context,
            "bash",
            json!({ "command": "sleep 100 & echo $$ $!; wait" }),
        )
        .await
    });
    // Cancel only once the command has started its background child.
    let printed = rx.recv().await.expect("a progress chunk");
    s.context.cancel.cancel();
    let ran = run.await.expect("run task");
    assert_eq!(ran, Err(Error::Interrupted));
    for pid in pids(&printed) {
        assert_process_ends(pid).await;
    }
}

#[tokio::test]
async fn bash_returns_when_the_command_exits_without_waiting_for_background_children() {
    let s = Session::new();
    let ran = s
        .call(
            "bash",
            json!({ "command": "sleep 100 & echo $!; echo done", "timeout_ms": 60_000 }),
        )
        .await
        .expect("bash");
    let out = text(&ran);
    let mut lines = out.lines();
    let pid: i32 = lines
        .next()
        .and_then(|l| l.parse().ok())
        .expect("the background pid");
    assert_eq!(lines.next(), Some("done"));
    // Clean up the child this test left running on purpose.
    // SAFETY: kill only sends a signal.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    assert_process_ends(pid).await;
}

/// The pids a command printed (as `echo $$ $!`) in a progress chunk.
fn pids(chunk: &Value) -> Vec<i32> {
    let output = chunk["output"].as_str().expect("output text");
    let pids: Vec<i32> = output
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    assert_eq!(pids.len(), 2, "{output:?}");
    pids
}

/// Waits (via a pidfd, without polling) until `pid` has exited; fails if it is still
/// running after a generous bound.
async fn assert_process_ends(pid: i32) {
    tokio::task::spawn_blocking(move || {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            let error = std::io::Error::last_os_error();
            assert_eq!(
                error.raw_os_error(),
                Some(libc::ESRCH),
                "pidfd_open({pid}): {error}"
            );
            return; // already gone and reaped
        }
        let fd = i32::try_from(fd).expect("a descriptor fits in an int");
        let mut poll = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; the descriptor is closed right after.
        let ready = unsafe { libc::poll(&mut poll, 1, 30_000) };
        // SAFETY: closing the descriptor pidfd_open returned.
        unsafe { libc::close(fd) };
        assert_eq!(ready, 1, "process {pid} is still running");
    })
    .await
    .expect("pidfd wait");
}
