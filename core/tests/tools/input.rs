//! What every tool shares: strict input, the catalog, permission patterns, truncation.

use keel_core::tool::{Error, Limits, Output, builtins};
use keel_schema::types::{Effect, ToolContent};
use serde_json::json;

use super::support::*;

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
    let registry = builtins();
    let tools: Vec<_> = registry.iter().map(|t| (t.name(), t.effect())).collect();
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
    let s = Session::new();
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
        assert_eq!(
            tool(name).permission_pattern(&input, &s.root),
            pattern,
            "{name}"
        );
    }
}

#[test]
fn a_file_tools_permission_pattern_is_where_the_path_really_is_inside_the_session() {
    let s = Session::new();
    s.file("secrets/key.txt", "k");
    s.link("docs", s.root.join("secrets"));
    let absolute = s.root.join("secrets/key.txt");
    let cases = [
        "./secrets/key.txt",
        "secrets/./x/../key.txt",
        absolute.to_str().unwrap(),
        // A symlink is checked as what it reaches.
        "docs/key.txt",
    ];
    for path in cases {
        assert_eq!(
            tool("read").permission_pattern(&json!({ "path": path }), &s.root),
            "secrets/key.txt",
            "{path}"
        );
    }
    // A path that leaves the session is left as written; the tool refuses it.
    assert_eq!(
        tool("read").permission_pattern(&json!({ "path": "../outside/secret.txt" }), &s.root),
        "../outside/secret.txt"
    );
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
