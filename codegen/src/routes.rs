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

/// An optional request header the route reads: a string of 1 to `max_length` characters.
#[derive(Debug, Clone, Copy)]
pub struct Header {
    pub name: &'static str,
    pub description: &'static str,
    pub max_length: usize,
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
    /// Optional request headers beyond the bearer token.
    pub headers: &'static [Header],
    pub query: Option<Type>,
    pub body: Option<Type>,
    pub response: Response,
    /// Whether the bearer token (when configured) is required.
    pub auth: bool,
    /// Whether the route can answer 409 Conflict.
    pub conflicts: bool,
    /// Whether the route checks a token of its own (the login), so can answer 401
    /// although it is public.
    pub checks_token: bool,
}

impl Route {
    /// The error statuses this route can answer with, ascending.
    pub fn error_statuses(&self) -> Vec<u16> {
        let mut statuses = vec![400];
        if self.auth || self.checks_token {
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

impl Route {
    /// A route that requires the token, takes no parameters, query or body, and cannot conflict.
    const fn new(
        method: Method,
        path: &'static str,
        operation: &'static str,
        response: Response,
    ) -> Self {
        Self {
            method,
            path,
            operation,
            summary: "",
            params: &[],
            headers: &[],
            query: None,
            body: None,
            response,
            auth: true,
            conflicts: false,
            checks_token: false,
        }
    }

    const fn get(path: &'static str, operation: &'static str, response: Response) -> Self {
        Self::new(Method::Get, path, operation, response)
    }

    const fn post(path: &'static str, operation: &'static str, response: Response) -> Self {
        Self::new(Method::Post, path, operation, response)
    }

    const fn patch(path: &'static str, operation: &'static str, response: Response) -> Self {
        Self::new(Method::Patch, path, operation, response)
    }

    const fn delete(path: &'static str, operation: &'static str, response: Response) -> Self {
        Self::new(Method::Delete, path, operation, response)
    }

    const fn summary(mut self, summary: &'static str) -> Self {
        self.summary = summary;
        self
    }

    const fn params(mut self, params: &'static [Param]) -> Self {
        self.params = params;
        self
    }

    const fn headers(mut self, headers: &'static [Header]) -> Self {
        self.headers = headers;
        self
    }

    const fn query(mut self, query: Type) -> Self {
        self.query = Some(query);
        self
    }

    const fn body(mut self, body: Type) -> Self {
        self.body = Some(body);
        self
    }

    /// Served without the bearer token.
    const fn public(mut self) -> Self {
        self.auth = false;
        self
    }

    /// Checks a token given in its body: can answer 401 although public.
    const fn checks_token(mut self) -> Self {
        self.checks_token = true;
        self
    }

    /// Can answer 409 Conflict.
    const fn conflicts(mut self) -> Self {
        self.conflicts = true;
        self
    }
}

const fn json(status: u16, ty: Type) -> Response {
    Response::Json { status, ty }
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
    Route::get("/api/health", "health", json(200, ty!(Health)))
        .summary("Whether the server is up, and its version. Never requires a token.")
        .public(),
    Route::get("/api/ready", "ready", json(200, ty!(Ready)))
        .summary(
            "Whether the server can do its work: the database answers a query, the writer \
             commits, and on PostgreSQL the connection to the other nodes is up, each \
             within 2 s. A 503 names the check that failed. Never requires a token.",
        )
        .public(),
    Route::post("/api/login", "login", Response::Empty { status: 204 })
        .summary(
            "Exchange the server's token for a read cookie (HttpOnly, SameSite=Strict, for the \
             browser session): it authenticates GET requests, the event streams among them, \
             so a browser need not put the token in a URL. Writes still need the bearer \
             token. Without a configured token, nothing is set.",
        )
        .body(ty!(LoginRequest))
        .public()
        .checks_token(),
    Route::post("/api/logout", "logout", Response::Empty { status: 204 })
        .summary("Clear the read cookie.")
        .public(),
    Route::post("/api/session", "create_session", json(201, ty!(Session)))
        .summary(
            "Create a session. A directory that does not exist, or is outside the server's \
             root, is a 400.",
        )
        .body(ty!(CreateSession)),
    Route::get("/api/session", "list_sessions", json(200, ty!(SessionList)))
        .summary("List sessions, newest first, a page at a time.")
        .query(ty!(ListSessionsQuery)),
    Route::get("/api/session/{id}", "get_session", json(200, ty!(Session)))
        .summary("Read a session.")
        .params(&[SESSION]),
    Route::patch(
        "/api/session/{id}",
        "update_session",
        json(200, ty!(Session)),
    )
    .summary(
        "Rename a session, or switch its agent or model for later steps. A session deleted \
         while the request runs is a 409.",
    )
    .params(&[SESSION])
    .body(ty!(UpdateSession))
    .conflicts(),
    Route::delete(
        "/api/session/{id}",
        "delete_session",
        Response::Empty { status: 204 },
    )
    .summary("Delete a session. Its log is kept.")
    .params(&[SESSION])
    .conflicts(),
    Route::get(
        "/api/session/{id}/status",
        "session_status",
        json(200, ty!(SessionStatus)),
    )
    .summary("Whether the session is busy, its execution claim, and its pending inputs.")
    .params(&[SESSION]),
    Route::post(
        "/api/session/{id}/prompt",
        "prompt",
        json(202, ty!(PromptResponse)),
    )
    .summary(
        "Admit a prompt. The same idempotency key (`id` or the `Idempotency-Key` header) \
                  with the same content returns the original (`replayed: true`); with other \
                  content it is a 409.",
    )
    .params(&[SESSION])
    .headers(&[Header {
        name: "Idempotency-Key",
        description: "The idempotency key, as an alternative to the body's `id` (equal to it \
                      when both are sent), in visible ASCII.",
        max_length: 128,
    }])
    .body(ty!(PromptRequest))
    .conflicts(),
    Route::post(
        "/api/session/{id}/interrupt",
        "interrupt",
        json(200, ty!(InterruptResponse)),
    )
    .summary("Interrupt the running execution; returns before cleanup finishes.")
    .params(&[SESSION]),
    Route::post(
        "/api/session/{id}/resume",
        "resume",
        json(202, ty!(SessionStatus)),
    )
    .summary(
        "Start an execution, or join the running one. A session deleted while the request \
         runs is a 409.",
    )
    .params(&[SESSION])
    .conflicts(),
    Route::post(
        "/api/session/{id}/compact",
        "compact",
        json(202, ty!(PromptResponse)),
    )
    .summary(
        "Request a compaction of the session's history: admits a control input, promoted \
         in admission order before any steering prompt admitted after it. A session \
         deleted while the request runs is a 409.",
    )
    .params(&[SESSION])
    .conflicts(),
    Route::post(
        "/api/session/{id}/permission/{request_id}",
        "reply_permission",
        json(200, ty!(Accepted)),
    )
    .summary("Answer a permission request: once, always (for the session), or reject.")
    .params(&[SESSION, REQUEST])
    .body(ty!(PermissionReply))
    .conflicts(),
    Route::post(
        "/api/session/{id}/question/{request_id}",
        "reply_question",
        json(200, ty!(Accepted)),
    )
    .summary("Answer or dismiss a question.")
    .params(&[SESSION, REQUEST])
    .body(ty!(QuestionReply))
    .conflicts(),
    Route::get(
        "/api/session/{id}/messages",
        "messages",
        json(200, ty!(MessageList)),
    )
    .summary("The projected transcript.")
    .params(&[SESSION]),
    Route::get(
        "/api/session/{id}/log",
        "session_log",
        Response::EventStream { item: ty!(LogItem) },
    )
    .summary(
        "The durable log as server-sent events: events after `after` (each with \
                  `id:` = seq), one `synced` marker, then live events while `follow`. \
                  `Last-Event-ID` wins over `after`.",
    )
    .params(&[SESSION])
    .query(ty!(LogQuery)),
    Route::get(
        "/api/event",
        "events",
        Response::EventStream {
            item: ty!(LiveItem),
        },
    )
    .summary(
        "Live events of all sessions as server-sent events. A subscriber that falls \
                  behind is sent `lagged` and disconnected.",
    ),
    Route::get("/api/agents", "agents", json(200, ty!(AgentList)))
        .summary("The agents sessions can use, with each one's model and the tools it offers."),
    Route::get("/api/mcp", "mcp_servers", json(200, ty!(McpServerList))).summary(
        "The MCP tool servers of keel.toml: whether each is idle, starting, ready or failed \
         (with the reason), and the tools it offers.",
    ),
    Route::get("/api/nodes", "nodes", json(200, ty!(NodeList)))
        .summary("The live Keel processes sharing the database, with the sessions each owns."),
    Route::get("/openapi.json", "openapi", json(200, OPENAPI_DOCUMENT)).summary("This contract."),
];
