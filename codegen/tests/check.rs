//! `cargo xtask check`'s comparisons catch what they promise to.

use std::collections::BTreeMap;

use keel_codegen::check::{self, Published};
use keel_codegen::{File, INDEX_PATH, generate};
use serde_json::Value;

const TOOL_CALLED: &str = "contracts/events/session.next.tool.called.1.json";

fn on_disk(files: &[File]) -> BTreeMap<String, String> {
    files
        .iter()
        .map(|f| (f.path.clone(), f.contents.clone()))
        .collect()
}

/// Every event schema as if published on main with today's contents.
fn published_now(files: &[File]) -> BTreeMap<String, Published> {
    files
        .iter()
        .filter(|f| f.path.starts_with("contracts/events/"))
        .map(|f| {
            let published = Published {
                contents: f.contents.clone(),
                source: "on `main` since 0123456789ab".into(),
            };
            (f.path.clone(), published)
        })
        .collect()
}

fn edit(files: &mut [File], path: &str, change: impl FnOnce(&mut Value)) {
    let file = files.iter_mut().find(|f| f.path == path).unwrap();
    let mut schema: Value = serde_json::from_str(&file.contents).unwrap();
    change(&mut schema);
    file.contents = keel_codegen::pretty(&schema);
}

#[test]
fn fresh_contracts_pass_every_check() {
    let files = generate();
    let disk = on_disk(&files);
    assert_eq!(check::stale(&files, &disk), vec![]);
    assert_eq!(check::index_agrees_with_files(&disk), vec![]);
    assert_eq!(check::published(&files, &published_now(&files)), vec![]);
}

#[test]
fn editing_a_payload_field_of_a_published_event_asks_for_a_new_version() {
    let published = published_now(&generate());
    let mut edited = generate();
    edit(&mut edited, TOOL_CALLED, |schema| {
        schema["properties"]["effect"] = serde_json::json!({"type": "string"});
    });
    let problems = check::published(&edited, &published);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].path, TOOL_CALLED);
    assert_eq!(
        problems[0].message,
        "event `session.next.tool.called` version 1 is published (on `main` since \
         0123456789ab) and its schema changed at /properties/effect/enum: published versions never \
         change; add a new version instead (see docs/events.md)"
    );
}

#[test]
fn adding_a_required_field_to_a_published_event_asks_for_a_new_version() {
    let published = published_now(&generate());
    let mut edited = generate();
    edit(&mut edited, TOOL_CALLED, |schema| {
        schema["required"]
            .as_array_mut()
            .unwrap()
            .push("extra".into());
    });
    let problems = check::published(&edited, &published);
    assert_eq!(problems.len(), 1);
    assert!(problems[0].message.contains("add a new version"));
}

#[test]
fn rewording_descriptions_or_examples_of_a_published_event_is_allowed() {
    let published = published_now(&generate());
    let mut edited = generate();
    edit(&mut edited, TOOL_CALLED, |schema| {
        schema["description"] = "Reworded.".into();
        schema["examples"] = serde_json::json!([]);
        schema["properties"]["call_id"]["description"] = "Reworded too.".into();
    });
    assert_eq!(check::published(&edited, &published), vec![]);
}

#[test]
fn a_property_named_description_is_compared_not_stripped() {
    let schema = serde_json::json!({
        "description": "annotation",
        "properties": {"description": {"type": "string", "description": "annotation"}},
    });
    assert_eq!(
        check::contract_shape(schema),
        serde_json::json!({"properties": {"description": {"type": "string"}}})
    );
}

#[test]
fn removing_a_published_version_from_the_catalog_is_refused() {
    let published = published_now(&generate());
    let without: Vec<File> = generate()
        .into_iter()
        .filter(|f| f.path != TOOL_CALLED)
        .collect();
    let problems = check::published(&without, &published);
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].path, TOOL_CALLED);
    assert!(problems[0].message.contains("is gone from the catalog"));
}

#[test]
fn a_stale_missing_or_extra_file_is_named() {
    let files = generate();
    let mut disk = on_disk(&files);
    disk.get_mut("contracts/openapi.json").unwrap().push(' ');
    disk.remove("client/src/generated.rs");
    disk.insert(
        "contracts/events/session.next.gone.1.json".into(),
        "{}".into(),
    );
    let problems: Vec<(String, String)> = check::stale(&files, &disk)
        .into_iter()
        .map(|p| (p.path, p.message.split(':').next().unwrap().to_owned()))
        .collect();
    assert_eq!(
        problems,
        vec![
            ("contracts/openapi.json".to_owned(), "stale".to_owned()),
            ("client/src/generated.rs".to_owned(), "missing".to_owned()),
            (
                "contracts/events/session.next.gone.1.json".to_owned(),
                "not in the event catalog".to_owned()
            ),
        ]
    );
}

#[test]
fn an_index_that_disagrees_with_the_files_is_named() {
    let files = generate();
    let mut disk = on_disk(&files);
    disk.remove(TOOL_CALLED);
    disk.insert("contracts/events/extra.1.json".into(), "{}".into());
    let problems: Vec<String> = check::index_agrees_with_files(&disk)
        .into_iter()
        .map(|p| {
            assert_eq!(p.path, INDEX_PATH);
            p.message
        })
        .collect();
    assert_eq!(
        problems,
        vec![
            format!("lists {TOOL_CALLED}, which does not exist"),
            "does not list contracts/events/extra.1.json, which exists".to_owned(),
        ]
    );
}
