//! The OpenAPI 3.2 document, assembled from [`crate::routes::ROUTES`] and the schemas of
//! keel-schema's API types (JSON Schema 2020-12, which OpenAPI uses as is). 3.2 is what
//! describes an event stream item by item (`itemSchema`), so standard tools check each
//! server-sent event against its schema.

use schemars::generate::SchemaSettings;
use schemars::{Schema, SchemaGenerator};
use serde_json::{Map, Value, json};

use crate::routes::{ROUTES, Response, Route};

const COMPONENTS: &str = "/components/schemas";

/// The reason phrase used to describe each error status.
fn error_description(status: u16) -> &'static str {
    match status {
        400 => "Bad input: malformed JSON, wrong types, unknown fields, or a malformed id.",
        401 => "No bearer token, or a wrong one.",
        404 => "No such session, request or route.",
        409 => "Conflicts with the current state.",
        413 => "The body is over the configured limit.",
        422 => "Well-formed but invalid.",
        500 => "A fault in Keel or its database; the message says what failed.",
        503 => "Shutting down, or the database is unreachable.",
        _ => "Error.",
    }
}

fn operation(route: &Route, generator: &mut SchemaGenerator) -> Value {
    let mut parameters: Vec<Value> = route
        .params
        .iter()
        .map(|param| {
            json!({
                "name": param.name,
                "in": "path",
                "required": true,
                "schema": (param.ty.reference)(generator),
            })
        })
        .collect();
    parameters.extend(route.headers.iter().map(|header| {
        json!({
            "name": header.name,
            "in": "header",
            "required": false,
            "description": header.description,
            "schema": {"type": "string", "minLength": 1, "maxLength": header.max_length},
        })
    }));
    if let Some(query) = route.query {
        let schema = (query.inline)(generator).to_value();
        let required: Vec<&str> = schema["required"]
            .as_array()
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if let Some(properties) = schema["properties"].as_object() {
            for (name, property) in properties {
                let mut parameter = json!({
                    "name": name,
                    "in": "query",
                    "required": required.contains(&name.as_str()),
                    "schema": property,
                });
                if let Some(description) = property.get("description") {
                    parameter["description"] = description.clone();
                }
                parameters.push(parameter);
            }
        }
    }

    let mut responses = Map::new();
    match route.response {
        Response::Json { status, ty } => {
            responses.insert(
                status.to_string(),
                json!({
                    "description": "Success.",
                    "content": {"application/json": {"schema": (ty.reference)(generator)}},
                }),
            );
        }
        Response::Empty { status } => {
            responses.insert(status.to_string(), json!({"description": "Success."}));
        }
        Response::EventStream { item } => {
            responses.insert(
                "200".to_owned(),
                json!({
                    "description": "A server-sent event stream. Each event's `data` is one JSON \
                                    value of the `contentSchema`; comment lines are heartbeats.",
                    "content": {"text/event-stream": {"itemSchema": stream_item((item.reference)(generator))}},
                }),
            );
        }
    }
    for status in route.error_statuses() {
        responses.insert(
            status.to_string(),
            json!({"$ref": format!("#/components/responses/Error{status}")}),
        );
    }

    let mut op = json!({
        "operationId": route.operation,
        "summary": route.summary,
        "responses": responses,
    });
    if !parameters.is_empty() {
        op["parameters"] = Value::Array(parameters);
    }
    if let Some(body) = route.body {
        op["requestBody"] = json!({
            "required": true,
            "content": {"application/json": {"schema": (body.reference)(generator)}},
        });
    }
    if !route.auth {
        op["security"] = json!([]);
    }
    op
}

/// OpenAPI 3.2's description of one server-sent event whose `data` is JSON of `data`:
/// the fields of the event as the SSE format defines them.
fn stream_item(data: Schema) -> Value {
    json!({
        "type": "object",
        "required": ["data"],
        "properties": {
            "id": {
                "type": "string",
                "description": "The durable event's seq, in decimal; absent on ephemeral events \
                                and markers. A reconnect sends the last one as `Last-Event-ID`.",
            },
            "event": {
                "type": "string",
                "description": "Absent on events; `synced` or `lagged` on the stream's markers.",
            },
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": data,
            },
            "retry": {"type": "integer", "minimum": 0},
        },
    })
}

/// The whole document.
pub fn document() -> Value {
    let mut generator = SchemaSettings::draft2020_12()
        .with(|s| s.definitions_path = COMPONENTS.into())
        .into_generator();

    let mut paths = Map::new();
    for route in ROUTES {
        let item = paths
            .entry(route.path.to_owned())
            .or_insert_with(|| json!({}));
        item[route.method.openapi()] = operation(route, &mut generator);
    }

    let error_schema = generator.subschema_for::<keel_schema::api::ErrorBody>();
    let mut statuses: Vec<u16> = ROUTES.iter().flat_map(Route::error_statuses).collect();
    statuses.sort_unstable();
    statuses.dedup();
    let responses: Map<String, Value> = statuses
        .into_iter()
        .map(|status| {
            (
                format!("Error{status}"),
                json!({
                    "description": error_description(status),
                    "content": {"application/json": {"schema": error_schema}},
                }),
            )
        })
        .collect();

    let mut schemas = generator.take_definitions(true);
    schemas.sort_keys();

    json!({
        "openapi": "3.2.0",
        "info": {
            "title": "Keel",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "A durable session engine for AI coding agents. Generated by \
                            `cargo xtask regenerate`; do not edit.",
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "servers": [{"url": "http://127.0.0.1:4096"}],
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "responses": responses,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The value of KEEL_TOKEN, when the server has one.",
                },
            },
        },
    })
}
