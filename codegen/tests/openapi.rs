//! `contracts/openapi.json` is an OpenAPI 3.2 document that covers every route.
//!
//! oas3 (the Rust parser used here) validates versions up to 3.1 only, so it is asked to
//! parse the document, not to vouch for its version; schemathesis, which reads 3.2,
//! checks the served contract against the running service (docs/service.md).

use std::collections::BTreeSet;

use keel_codegen::openapi;
use keel_codegen::routes::{ROUTES, Response};
use serde_json::Value;

fn document_text() -> String {
    keel_codegen::pretty(&openapi::document())
}

#[test]
fn document_parses_as_openapi_3_2() {
    let spec = oas3::from_json(document_text()).expect("oas3 parses the document");
    assert_eq!(spec.openapi, "3.2.0");
    let operations: BTreeSet<String> = spec
        .operations()
        .map(|(path, method, op)| {
            format!(
                "{} {path} {}",
                method.as_str(),
                op.operation_id.clone().unwrap_or_default()
            )
        })
        .collect();
    let routes: BTreeSet<String> = ROUTES
        .iter()
        .map(|r| format!("{} {} {}", r.method.rust(), r.path, r.operation))
        .collect();
    assert_eq!(operations, routes);
}

#[test]
fn every_reference_resolves_inside_the_document() {
    let document = openapi::document();
    fn walk(value: &Value, document: &Value, refs: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(target)) = map.get("$ref") {
                    refs.push(target.clone());
                    let pointer = target
                        .strip_prefix('#')
                        .unwrap_or_else(|| panic!("{target} is not a local reference"));
                    assert!(
                        document.pointer(pointer).is_some(),
                        "{target} does not resolve"
                    );
                }
                map.values().for_each(|v| walk(v, document, refs));
            }
            Value::Array(list) => list.iter().for_each(|v| walk(v, document, refs)),
            _ => {}
        }
    }
    let mut refs = Vec::new();
    walk(&document, &document, &mut refs);
    assert!(
        refs.len() > 50,
        "the document uses references ({} found)",
        refs.len()
    );
}

#[test]
fn every_component_schema_is_a_valid_json_schema() {
    let document = openapi::document();
    let schemas = document["components"]["schemas"].as_object().unwrap();
    for (name, schema) in schemas {
        if let Err(e) = jsonschema::meta::validate(schema) {
            panic!("components/schemas/{name}: {e}");
        }
    }
}

#[test]
fn path_parameters_match_the_path_templates() {
    let document = openapi::document();
    for route in ROUTES {
        let op = &document["paths"][route.path][route.method.openapi()];
        let declared: BTreeSet<&str> = op["parameters"]
            .as_array()
            .map(|p| {
                p.iter()
                    .filter(|p| p["in"] == "path")
                    .filter_map(|p| p["name"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        let templated: BTreeSet<&str> = route
            .path
            .split('/')
            .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .collect();
        assert_eq!(
            declared,
            templated,
            "{} {}",
            route.method.rust(),
            route.path
        );
    }
}

#[test]
fn the_probes_and_the_login_are_the_only_routes_without_the_bearer_token() {
    let document = openapi::document();
    let open: Vec<&str> = ROUTES
        .iter()
        .filter(|r| {
            document["paths"][r.path][r.method.openapi()]["security"] == Value::Array(vec![])
        })
        .map(|r| r.path)
        .collect();
    assert_eq!(
        open,
        vec!["/api/health", "/api/ready", "/api/login", "/api/logout"]
    );
}

#[test]
fn event_streams_describe_their_items() {
    let document = openapi::document();
    for route in ROUTES {
        if let Response::EventStream { item } = route.response {
            let content = &document["paths"][route.path]["get"]["responses"]["200"]["content"];
            let item_schema = &content["text/event-stream"]["itemSchema"];
            assert_eq!(
                item_schema["properties"]["data"]["contentSchema"]["$ref"],
                format!("#/components/schemas/{}", item.rust),
                "{}",
                route.path
            );
            assert_eq!(
                item_schema["properties"]["data"]["contentMediaType"], "application/json",
                "{}",
                route.path
            );
            assert_eq!(item_schema["required"], serde_json::json!(["data"]));
        }
    }
}
