//! Checks that keep contracts honest.
//!
//! - Every generated file on disk equals what the code generates now ([`stale`]).
//! - `contracts/events/` holds exactly the catalog's files, and `index.json` lists exactly
//!   the files present ([`stale`] and [`index_agrees_with_files`]).
//! - A published event version never changes ([`published`]): its schema, ignoring
//!   descriptions, titles and examples, must equal the one first published.
//!
//! The caller supplies what is on disk and what was published; this module only compares.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde_json::Value;

use crate::{EVENTS_DIR, File, INDEX_PATH};

/// One thing wrong with the contracts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file it concerns, relative to the workspace root.
    pub path: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Generated files that differ from disk, are missing, or are on disk without being generated.
///
/// `on_disk` maps each existing generated path, and every file under `contracts/events/`,
/// to its contents.
pub fn stale(generated: &[File], on_disk: &BTreeMap<String, String>) -> Vec<Problem> {
    let mut problems = Vec::new();
    for file in generated {
        match on_disk.get(&file.path) {
            None => problems.push(Problem {
                path: file.path.clone(),
                message: "missing: run `cargo xtask regenerate`".into(),
            }),
            Some(contents) if *contents != file.contents => problems.push(Problem {
                path: file.path.clone(),
                message: "stale: it differs from what the code generates; run `cargo xtask \
                          regenerate` and commit the result"
                    .into(),
            }),
            Some(_) => {}
        }
    }
    let generated_paths: BTreeSet<&str> = generated.iter().map(|f| f.path.as_str()).collect();
    for path in on_disk.keys() {
        if path.starts_with(EVENTS_DIR) && !generated_paths.contains(path.as_str()) {
            problems.push(Problem {
                path: path.clone(),
                message: "not in the event catalog: the catalog and the files disagree (an \
                          event version removed from keel-schema, or a file added by hand)"
                    .into(),
            });
        }
    }
    problems
}

/// Whether `index.json` on disk lists exactly the schema files on disk.
pub fn index_agrees_with_files(on_disk: &BTreeMap<String, String>) -> Vec<Problem> {
    let problem = |message: String| Problem {
        path: INDEX_PATH.to_owned(),
        message,
    };
    let Some(index) = on_disk.get(INDEX_PATH) else {
        return vec![problem("missing: run `cargo xtask regenerate`".into())];
    };
    let index: Value = match serde_json::from_str(index) {
        Ok(index) => index,
        Err(e) => return vec![problem(format!("not valid JSON: {e}"))],
    };
    let Some(events) = index["events"].as_array() else {
        return vec![problem("has no `events` list".into())];
    };
    let listed: BTreeSet<String> = events
        .iter()
        .filter_map(|e| e["file"].as_str())
        .map(|file| format!("{EVENTS_DIR}/{file}"))
        .collect();
    let present: BTreeSet<String> = on_disk
        .keys()
        .filter(|p| p.starts_with(EVENTS_DIR) && *p != INDEX_PATH)
        .cloned()
        .collect();
    let mut problems = Vec::new();
    for path in listed.difference(&present) {
        problems.push(problem(format!("lists {path}, which does not exist")));
    }
    for path in present.difference(&listed) {
        problems.push(problem(format!("does not list {path}, which exists")));
    }
    problems
}

/// A published event schema: its contents and where it was published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub contents: String,
    /// Where it was first published (a commit), for the message.
    pub source: String,
}

/// Published event versions whose schema changed or that are gone from the catalog.
///
/// `published` maps each published schema's path (`contracts/events/<key>.json`) to what
/// was published. Descriptions, titles and examples may change; nothing else may.
pub fn published(generated: &[File], published: &BTreeMap<String, Published>) -> Vec<Problem> {
    let generated: BTreeMap<&str, &str> = generated
        .iter()
        .map(|f| (f.path.as_str(), f.contents.as_str()))
        .collect();
    let mut problems = Vec::new();
    for (path, old) in published {
        if path == INDEX_PATH || !path.starts_with(EVENTS_DIR) {
            continue;
        }
        let key = path
            .trim_start_matches(EVENTS_DIR)
            .trim_start_matches('/')
            .trim_end_matches(".json");
        let (type_name, version) = key.rsplit_once('.').unwrap_or((key, "?"));
        let Some(new) = generated.get(path.as_str()) else {
            problems.push(Problem {
                path: path.clone(),
                message: format!(
                    "event `{type_name}` version {version} was published ({}) and is gone from \
                     the catalog: published versions stay decodable forever; restore it (move \
                     its payload to keel-schema's event::legacy) and add a new version",
                    old.source
                ),
            });
            continue;
        };
        let old_schema = serde_json::from_str::<Value>(&old.contents).map(contract_shape);
        let new_schema = serde_json::from_str::<Value>(new).map(contract_shape);
        match (old_schema, new_schema) {
            (Ok(old_schema), Ok(new_schema)) if old_schema == new_schema => {}
            (Ok(old_schema), Ok(new_schema)) => problems.push(Problem {
                path: path.clone(),
                message: format!(
                    "event `{type_name}` version {version} is published ({}) and its schema \
                     changed at {}: published versions never change; add a new version instead \
                     (see docs/events.md)",
                    old.source,
                    first_difference(&old_schema, &new_schema, String::new())
                ),
            }),
            (Err(e), _) | (_, Err(e)) => problems.push(Problem {
                path: path.clone(),
                message: format!("not valid JSON: {e}"),
            }),
        }
    }
    problems
}

/// A schema without the keywords that do not change what it accepts.
///
/// Only keyword positions are touched: a property that happens to be named `description`
/// stays, since property names are walked as names, not keywords.
pub fn contract_shape(mut schema: Value) -> Value {
    strip_annotations(&mut schema);
    schema
}

fn strip_annotations(schema: &mut Value) {
    let Value::Object(map) = schema else { return };
    for annotation in ["description", "title", "examples", "$comment"] {
        map.remove(annotation);
    }
    for (keyword, value) in map.iter_mut() {
        match keyword.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Value::Object(named) = value {
                    named.values_mut().for_each(strip_annotations);
                }
            }
            "allOf" | "anyOf" | "oneOf" | "prefixItems" => {
                if let Value::Array(list) = value {
                    list.iter_mut().for_each(strip_annotations);
                }
            }
            "items"
            | "additionalProperties"
            | "not"
            | "if"
            | "then"
            | "else"
            | "contains"
            | "propertyNames"
            | "unevaluatedItems"
            | "unevaluatedProperties" => strip_annotations(value),
            // `const`, `enum`, `default` and the like hold data, not schemas.
            _ => {}
        }
    }
}

/// A JSON pointer to the first place where two values differ.
fn first_difference(old: &Value, new: &Value, at: String) -> String {
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) if x == y => {}
                    (Some(x), Some(y)) => return first_difference(x, y, format!("{at}/{key}")),
                    _ => return format!("{at}/{key}"),
                }
            }
            at_or_root(at)
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find(|(_, (x, y))| x != y)
            .map(|(i, (x, y))| first_difference(x, y, format!("{at}/{i}")))
            .unwrap_or_else(|| at_or_root(at)),
        _ => at_or_root(at),
    }
}

fn at_or_root(at: String) -> String {
    if at.is_empty() { "/".to_owned() } else { at }
}
