//! The projections' statements, each prepared once per connection (see
//! [`crate::store::fixed`]). Every event projects through one or two of them.

use diesel::sql_types::{BigInt, Bool, Double, Nullable, Text};

use crate::store::fixed::fixed_query;

fixed_query! {
    /// How every event of a step stores its assistant message: the hottest statement of
    /// the projector.
    pub(super) struct SetMessageData<'a> { id: &'a str, data: &'a str, seq: i64 }
    sql r#"UPDATE "session_message" SET "data" = "# {data: Text}
        r#", "updated_seq" = "# {seq: BigInt} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    /// [`SetMessageData`] for an edit of the message as this thread kept it at version
    /// `kept_at`: changes the row only while it is still at that version.
    pub(super) struct SetMessageDataIf<'a> { id: &'a str, data: &'a str, seq: i64, kept_at: i64 }
    sql r#"UPDATE "session_message" SET "data" = "# {data: Text}
        r#", "updated_seq" = "# {seq: BigInt} r#" WHERE "id" = "# {id: Text}
        r#" AND "updated_seq" = "# {kept_at: BigInt}
}

fixed_query! {
    pub(super) struct InsertMessage<'a> { id: &'a str, session_id: &'a str, seq: i64, role: &'a str, data: &'a str }
    sql r#"INSERT INTO "session_message" ("id", "session_id", "seq", "role", "data", "updated_seq") VALUES ("#
        {id: Text} ", " {session_id: Text} ", " {seq: BigInt} ", " {role: Text} ", "
        {data: Text} ", " {seq: BigInt} ")"
}

fixed_query! {
    pub(super) struct SetTitle<'a> { id: &'a str, title: &'a str }
    sql r#"UPDATE "session" SET "title" = "# {title: Text} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    pub(super) struct SetAgent<'a> { id: &'a str, agent: &'a str }
    sql r#"UPDATE "session" SET "agent" = "# {agent: Text} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    pub(super) struct SetModel<'a> { id: &'a str, provider: &'a str, model: &'a str }
    sql r#"UPDATE "session" SET "model_provider" = "# {provider: Text}
        r#", "model_id" = "# {model: Text} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    /// A session was created: one more not deleted.
    pub(super) struct CountCreated;
    sql r#"UPDATE "session_count" SET "live" = "live" + 1 WHERE "id" = 1"#
}

fixed_query! {
    /// A session was deleted: one fewer not deleted.
    pub(super) struct CountDeleted;
    sql r#"UPDATE "session_count" SET "live" = "live" - 1 WHERE "id" = 1"#
}

fixed_query! {
    pub(super) struct SetDeleted<'a> { id: &'a str, at: i64 }
    sql r#"UPDATE "session" SET "deleted_at" = "# {at: BigInt} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    /// Adds a step's usage and cost to the session's totals.
    pub(super) struct AddUsage<'a> {
        id: &'a str,
        input: i64,
        output: i64,
        reasoning: i64,
        cache_read: i64,
        cache_write: i64,
        cost: f64,
    }
    sql r#"UPDATE "session" SET "usage_input" = "usage_input" + "# {input: BigInt}
        r#", "usage_output" = "usage_output" + "# {output: BigInt}
        r#", "usage_reasoning" = "usage_reasoning" + "# {reasoning: BigInt}
        r#", "usage_cache_read" = "usage_cache_read" + "# {cache_read: BigInt}
        r#", "usage_cache_write" = "usage_cache_write" + "# {cache_write: BigInt}
        r#", "cost" = "cost" + "# {cost: Double} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    pub(super) struct RequestExecution<'a> { id: &'a str }
    sql r#"UPDATE "session_input" SET "execution_requested" = TRUE WHERE "id" = "# {id: Text}
}

fixed_query! {
    pub(super) struct CancelInput<'a> { id: &'a str, seq: i64 }
    sql r#"UPDATE "session_input" SET "cancelled_seq" = "# {seq: BigInt}
        r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    /// Promotes an input: a prompt with the message it became, a control input without.
    pub(super) struct PromoteInput<'a> { id: &'a str, seq: i64, message_id: Option<&'a str> }
    sql r#"UPDATE "session_input" SET "promoted_seq" = "# {seq: BigInt}
        r#", "message_id" = "# {message_id: Nullable<Text>} r#" WHERE "id" = "# {id: Text}
}

fixed_query! {
    /// A tool call's row, when its input starts streaming (pending) or it is called. A
    /// call whose row exists inserts nothing: the projection then reads that row to say
    /// why it refuses the event.
    pub(super) struct InsertTool<'a> {
        session_id: &'a str,
        call_id: &'a str,
        message_id: &'a str,
        name: &'a str,
        effect: Option<&'a str>,
        status: &'a str,
        provider_executed: bool,
        input: Option<&'a str>,
        rerun: bool,
    }
    sql r#"INSERT INTO "session_tool" ("session_id", "call_id", "message_id", "name", "effect", "status", "provider_executed", "input", "rerun") VALUES ("#
        {session_id: Text} ", " {call_id: Text} ", " {message_id: Text} ", " {name: Text} ", "
        {effect: Nullable<Text>} ", " {status: Text} ", " {provider_executed: Bool} ", "
        {input: Nullable<Text>} ", " {rerun: Bool} ") ON CONFLICT DO NOTHING"
}

fixed_query! {
    /// A streamed call, called: its row gets the parsed input, and may run again after a
    /// crash if its call says so (a row once marked stays marked). Only a row still
    /// pending under the message calling it changes.
    pub(super) struct CallTool<'a> {
        session_id: &'a str,
        call_id: &'a str,
        message_id: &'a str,
        name: &'a str,
        effect: &'a str,
        provider_executed: bool,
        input: &'a str,
        rerun: bool,
    }
    sql r#"UPDATE "session_tool" SET "name" = "# {name: Text} r#", "effect" = "# {effect: Text}
        r#", "status" = 'running', "provider_executed" = "# {provider_executed: Bool}
        r#", "input" = "# {input: Text} r#", "rerun" = "rerun" OR "# {rerun: Bool}
        r#" WHERE "session_id" = "# {session_id: Text} r#" AND "call_id" = "# {call_id: Text}
        r#" AND "message_id" = "# {message_id: Text} r#" AND "status" = 'pending'"#
}

fixed_query! {
    /// A call resolved, if it was not already.
    pub(super) struct ResolveTool<'a> { session_id: &'a str, call_id: &'a str, status: &'a str, output: &'a str }
    sql r#"UPDATE "session_tool" SET "status" = "# {status: Text} r#", "output" = "# {output: Text}
        r#" WHERE "session_id" = "# {session_id: Text} r#" AND "call_id" = "# {call_id: Text}
        r#" AND "status" NOT IN ('completed', 'error')"#
}

fixed_query! {
    /// [`ResolveTool`] and [`SettleRequests`] in one statement, for PostgreSQL, where each
    /// is a round trip (the settling usually changes nothing: few calls ask anything).
    /// Only an unresolved row changes, and it names its message, which the projection
    /// would otherwise read first. SQLite, without data-modifying `WITH`, runs the two.
    pub(super) struct ResolveAndSettle<'a> { session_id: &'a str, call_id: &'a str, status: &'a str, output: &'a str }
    returns Text;
    sql r#"WITH "settled" AS (UPDATE "session_request" SET "state" = 'settled' WHERE "session_id" = "#
        {session_id: Text} r#" AND "call_id" = "# {call_id: Text}
        r#" AND "state" <> 'settled') UPDATE "session_tool" SET "status" = "# {status: Text}
        r#", "output" = "# {output: Text} r#" WHERE "session_id" = "# {session_id: Text}
        r#" AND "call_id" = "# {call_id: Text}
        r#" AND "status" NOT IN ('completed', 'error') RETURNING "message_id""#
}

fixed_query! {
    /// A permission request or a question, asked.
    pub(super) struct InsertRequest<'a> {
        id: &'a str,
        session_id: &'a str,
        call_id: &'a str,
        kind: &'a str,
        tool: &'a str,
        asked_seq: i64,
        pattern: &'a str,
        rule: Option<&'a str>,
    }
    sql r#"INSERT INTO "session_request" ("id", "session_id", "call_id", "kind", "tool", "asked_seq", "state", "always", "pattern", "rule") VALUES ("#
        {id: Text} ", " {session_id: Text} ", " {call_id: Text} ", " {kind: Text} ", "
        {tool: Text} ", " {asked_seq: BigInt} ", 'pending', FALSE, " {pattern: Text} ", "
        {rule: Nullable<Text>} ")"
}

fixed_query! {
    /// A reply: updates the request only while it is pending, of this kind, in this
    /// session (the projection refuses a reply that updates nothing).
    pub(super) struct AnswerRequest<'a> {
        id: &'a str,
        session_id: &'a str,
        kind: &'a str,
        reply: &'a str,
        always: bool,
    }
    sql r#"UPDATE "session_request" SET "state" = 'answered', "reply" = "# {reply: Text}
        r#", "always" = "# {always: Bool} r#" WHERE "id" = "# {id: Text}
        r#" AND "session_id" = "# {session_id: Text} r#" AND "kind" = "# {kind: Text}
        r#" AND "state" = 'pending'"#
}

fixed_query! {
    /// A call resolved: its requests are settled.
    pub(super) struct SettleRequests<'a> { session_id: &'a str, call_id: &'a str }
    sql r#"UPDATE "session_request" SET "state" = 'settled' WHERE "session_id" = "#
        {session_id: Text} r#" AND "call_id" = "# {call_id: Text}
        r#" AND "state" <> 'settled'"#
}
