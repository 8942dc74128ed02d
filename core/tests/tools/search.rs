//! `list`, `glob` and `grep`.

use keel_core::tool::{Error, Output};
use keel_schema::types::ToolContent;
use serde_json::json;

use super::support::*;

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
