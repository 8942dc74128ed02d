//! The HTTP route table: the one source of the OpenAPI document and the client's
//! endpoint layer. Names here are fixed for operators and other programs (SPEC section 12):
//! add routes, never rename one without a new version.

use keel_schema::api;
use schemars::{JsonSchema, Schema, SchemaGenerator};

/// An HTTP method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Post,
    Patch,
    Delete,
}

impl Method {
    /// Lower case, as OpenAPI path items name operations.
    pub fn openapi(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::Post => "post",
            Self::Patch => "patch",
            Self::Delete => "delete",
        }
    }

    /// The `reqwest::Method` constant.
    pub fn rust(self) -> &'static str {
        match self {
            Self::Get => "GET",
            Self::Post => "POST",
            Self::Patch => "PATCH",
            Self::Delete => "DELETE",
        }
    }
}

/// A type carried by a route, with its schema.
#[derive(Clone, Copy)]
pub struct Type {
    /// How generated Rust code names it (in scope through `keel_schema::api::*`).
    pub rust: &'static str,
    /// A schema reference, registering the type's definition with the generator.
    pub reference: fn(&mut SchemaGenerator) -> Schema,
    /// The type's own schema, for query types whose properties become parameters.
    pub inline: fn(&mut SchemaGenerator) -> Schema,
}

impl std::fmt::Debug for Type {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.rust)
    }
}

fn reference<T: JsonSchema>(generator: &mut SchemaGenerator) -> Schema {
    generator.subschema_for::<T>()
}

fn inline<T: JsonSchema>(generator: &mut SchemaGenerator) -> Schema {
    T::json_schema(generator)
}

macro_rules! ty {
    ($name:ident) => {
        Type {
            rust: stringify!($name),
            reference: reference::<api::$name>,
            inline: inline::<api::$name>,
        }
    };
}

/// `GET /openapi.json` returns this document, which has no Rust type of its own.
const OPENAPI_DOCUMENT: Type = Type {
    rust: "serde_json::Value",
    reference: reference::<serde_json::Map<String, serde_json::Value>>,
    inline: inline::<serde_json::Map<String, serde_json::Value>>,
};

/// A path parameter: `{name}` in the path.
#[derive(Debug, Clone, Copy)]
pub struct Param {
    pub name: &'static str,
    pub ty: Type,
}

/// What a route answers with on success.
#[derive(Debug, Clone, Copy)]
pub enum Response {
    /// A JSON body.
    Json { status: u16, ty: Type },
    /// No body.
    Empty { status: u16 },
    /// A server-sent event stream; each message's `data:` is one `item`.
    EventStream { item: Type },
}

/// One route.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    pub method: Method,
    /// With `{param}` placeholders, as OpenAPI writes them.
    pub path: &'static str,
    /// snake_case; also the client method's name.
    pub operation: &'static str,
    pub summary: &'static str,
    pub params: &'static [Param],
    pub query: Option<Type>,
    pub body: Option<Type>,
    pub response: Response,
    /// Whether the bearer token (when configured) is required.
    pub auth: bool,
    /// Whether the route can answer 409 Conflict.
    pub conflicts: bool,
}

impl Route {
    /// The error statuses this route can answer with, ascending.
    pub fn error_statuses(&self) -> Vec<u16> {
        let mut statuses = vec![400];
        if self.auth {
            statuses.push(401);
        }
        if !self.params.is_empty() {
            statuses.push(404);
        }
        if self.conflicts {
            statuses.push(409);
        }
        if self.body.is_some() {
            statuses.extend([413, 422]);
        }
        statuses.extend([500, 503]);
        statuses
    }
}

const SESSION: Param = Param {
    name: "id",
    ty: ty!(SessionId),
};
const REQUEST: Param = Param {
    name: "request_id",
    ty: ty!(RequestId),
};

/// Every route of the service, in the order of SPEC section 12.
pub const ROUTES: &[Route] = &[
    Route {
        method: Method::Get,
        path: "/api/health",
        operation: "health",
        summary: "Whether the server is up, and its version. Never requires a token.",
        params: &[],
        query: None,
        body: None,
        response: Response::Json {
            status: 200,
            ty: ty!(Health),
        },
        auth: false,
        conflicts: false,
    },
    Route {
        method: Method::Post,
        path: "/api/session",
        operation: "create_session",
        summary: "Create a session. A directory that does not exist is a 400.",
        params: &[],
        query: None,
        body: Some(ty!(CreateSession)),
        response: Response::Json {
            status: 201,
            ty: ty!(Session),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Get,
        path: "/api/session",
        operation: "list_sessions",
        summary: "List sessions, newest first, a page at a time.",
        params: &[],
        query: Some(ty!(ListSessionsQuery)),
        body: None,
        response: Response::Json {
            status: 200,
            ty: ty!(SessionList),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Get,
        path: "/api/session/{id}",
        operation: "get_session",
        summary: "Read a session.",
        params: &[SESSION],
        query: None,
        body: None,
        response: Response::Json {
            status: 200,
            ty: ty!(Session),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Patch,
        path: "/api/session/{id}",
        operation: "update_session",
        summary: "Rename a session, or switch its agent or model for later steps.",
        params: &[SESSION],
        query: None,
        body: Some(ty!(UpdateSession)),
        response: Response::Json {
            status: 200,
            ty: ty!(Session),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Delete,
        path: "/api/session/{id}",
        operation: "delete_session",
        summary: "Delete a session. Its log is kept.",
        params: &[SESSION],
        query: None,
        body: None,
        response: Response::Empty { status: 204 },
        auth: true,
        conflicts: true,
    },
    Route {
        method: Method::Get,
        path: "/api/session/{id}/status",
        operation: "session_status",
        summary: "Whether the session is busy, its execution claim, and its pending inputs.",
        params: &[SESSION],
        query: None,
        body: None,
        response: Response::Json {
            status: 200,
            ty: ty!(SessionStatus),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Post,
        path: "/api/session/{id}/prompt",
        operation: "prompt",
        summary: "Admit a prompt. Same id and content returns the original (`replayed: true`); \
                  same id with other content is a 409.",
        params: &[SESSION],
        query: None,
        body: Some(ty!(PromptRequest)),
        response: Response::Json {
            status: 202,
            ty: ty!(PromptResponse),
        },
        auth: true,
        conflicts: true,
    },
    Route {
        method: Method::Post,
        path: "/api/session/{id}/interrupt",
        operation: "interrupt",
        summary: "Interrupt the running execution; returns before cleanup finishes.",
        params: &[SESSION],
        query: None,
        body: None,
        response: Response::Json {
            status: 200,
            ty: ty!(InterruptResponse),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Post,
        path: "/api/session/{id}/resume",
        operation: "resume",
        summary: "Start an execution, or join the running one.",
        params: &[SESSION],
        query: None,
        body: None,
        response: Response::Json {
            status: 202,
            ty: ty!(SessionStatus),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Post,
        path: "/api/session/{id}/compact",
        operation: "compact",
        summary: "Request a compaction of the session's history.",
        params: &[SESSION],
        query: None,
        body: None,
        response: Response::Json {
            status: 202,
            ty: ty!(Accepted),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Post,
        path: "/api/session/{id}/permission/{request_id}",
        operation: "reply_permission",
        summary: "Answer a permission request: once, always (for the session), or reject.",
        params: &[SESSION, REQUEST],
        query: None,
        body: Some(ty!(PermissionReply)),
        response: Response::Json {
            status: 200,
            ty: ty!(Accepted),
        },
        auth: true,
        conflicts: true,
    },
    Route {
        method: Method::Post,
        path: "/api/session/{id}/question/{request_id}",
        operation: "reply_question",
        summary: "Answer or dismiss a question.",
        params: &[SESSION, REQUEST],
        query: None,
        body: Some(ty!(QuestionReply)),
        response: Response::Json {
            status: 200,
            ty: ty!(Accepted),
        },
        auth: true,
        conflicts: true,
    },
    Route {
        method: Method::Get,
        path: "/api/session/{id}/messages",
        operation: "messages",
        summary: "The projected transcript.",
        params: &[SESSION],
        query: None,
        body: None,
        response: Response::Json {
            status: 200,
            ty: ty!(MessageList),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Get,
        path: "/api/session/{id}/log",
        operation: "session_log",
        summary: "The durable log as server-sent events: events after `after` (each with \
                  `id:` = seq), one `synced` marker, then live events while `follow`. \
                  `Last-Event-ID` wins over `after`.",
        params: &[SESSION],
        query: Some(ty!(LogQuery)),
        body: None,
        response: Response::EventStream { item: ty!(LogItem) },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Get,
        path: "/api/event",
        operation: "events",
        summary: "Live events of all sessions as server-sent events. A subscriber that falls \
                  behind is sent `lagged` and disconnected.",
        params: &[],
        query: None,
        body: None,
        response: Response::EventStream {
            item: ty!(LiveItem),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Get,
        path: "/api/nodes",
        operation: "nodes",
        summary: "The live Keel processes sharing the database, with the sessions each owns.",
        params: &[],
        query: None,
        body: None,
        response: Response::Json {
            status: 200,
            ty: ty!(NodeList),
        },
        auth: true,
        conflicts: false,
    },
    Route {
        method: Method::Get,
        path: "/openapi.json",
        operation: "openapi",
        summary: "This contract.",
        params: &[],
        query: None,
        body: None,
        response: Response::Json {
            status: 200,
            ty: OPENAPI_DOCUMENT,
        },
        auth: true,
        conflicts: false,
    },
];
