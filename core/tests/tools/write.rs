//! `write` and `edit`.

use keel_core::tool::Error;
use serde_json::json;

use super::support::*;

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

#[tokio::test]
async fn a_write_cancelled_as_it_starts_has_landed_or_not_when_it_returns_never_later() {
    let s = Session::new();
    s.context.cancel.cancel();
    let result = s
        .call("write", json!({"path": "late.txt", "content": "landed"}))
        .await;
    // The file system work cannot be stopped midway, so the call waits for it: its
    // result says what happened, and nothing happens after it returned.
    let output = result.expect("the write ran to its end");
    assert_eq!(output.structured["created"], json!(true));
    assert_eq!(
        std::fs::read_to_string(s.root.join("late.txt")).unwrap(),
        "landed"
    );
}
