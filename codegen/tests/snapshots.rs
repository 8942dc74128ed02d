//! Snapshots of the catalog and a sample of event schemas, so a change in a contract is a
//! visible diff in review.

use keel_codegen::events;
use keel_schema::event::catalog;

fn schema(key: &str) -> serde_json::Value {
    let entry = catalog()
        .find(|e| e.key() == key)
        .unwrap_or_else(|| panic!("{key} is in the catalog"));
    events::schema(entry)
}

#[test]
fn catalog_index() {
    insta::assert_json_snapshot!("index", events::index());
}

#[test]
fn sample_event_schemas() {
    for key in [
        "session.next.prompt.admitted.1",
        "session.next.tool.called.1",
        "session.next.tool.success.1",
        "session.next.tool.success.2",
        "session.next.step.ended.2",
        "session.next.text.delta.1",
    ] {
        insta::assert_json_snapshot!(key, schema(key));
    }
}
