//! diesel's view of the tables (see `migrations/`). Both backends share these definitions.

diesel::table! {
    session (id) {
        id -> Text,
        title -> Nullable<Text>,
        directory -> Text,
        agent -> Text,
        model_provider -> Text,
        model_id -> Text,
        time_created -> BigInt,
        time_updated -> BigInt,
        last_seq -> BigInt,
        usage_input -> BigInt,
        usage_output -> BigInt,
        usage_reasoning -> BigInt,
        usage_cache_read -> BigInt,
        usage_cache_write -> BigInt,
        cost -> Double,
        deleted_at -> Nullable<BigInt>,
    }
}

diesel::table! {
    event (session_id, seq) {
        session_id -> Text,
        seq -> BigInt,
        id -> Text,
        #[sql_name = "type"]
        type_name -> Text,
        version -> Integer,
        data -> Text,
        time -> BigInt,
    }
}

diesel::table! {
    session_message (id) {
        id -> Text,
        session_id -> Text,
        seq -> BigInt,
        role -> Text,
        data -> Text,
        updated_seq -> BigInt,
    }
}

diesel::table! {
    session_tool (session_id, call_id) {
        session_id -> Text,
        call_id -> Text,
        message_id -> Text,
        name -> Text,
        effect -> Nullable<Text>,
        status -> Text,
        provider_executed -> Bool,
        input -> Nullable<Text>,
        output -> Nullable<Text>,
        rerun -> Bool,
    }
}

diesel::table! {
    session_input (id) {
        id -> Text,
        session_id -> Text,
        kind -> Text,
        delivery -> Text,
        parts -> Text,
        source -> Text,
        request_execution -> Bool,
        admitted_seq -> BigInt,
        execution_requested -> Bool,
        promoted_seq -> Nullable<BigInt>,
        message_id -> Nullable<Text>,
        cancelled_seq -> Nullable<BigInt>,
    }
}

diesel::table! {
    session_execution (id) {
        id -> Text,
        session_id -> Text,
        owner_id -> Text,
        assistant_message_id -> Nullable<Text>,
        assistant_seq -> Nullable<BigInt>,
        phase -> Text,
        time_created -> BigInt,
        expires_at -> BigInt,
        recovery_error -> Nullable<Text>,
    }
}

diesel::table! {
    session_request (id) {
        id -> Text,
        session_id -> Text,
        call_id -> Text,
        kind -> Text,
        tool -> Text,
        asked_seq -> BigInt,
        state -> Text,
        reply -> Nullable<Text>,
        always -> Bool,
        pattern -> Text,
        rule -> Nullable<Text>,
    }
}

diesel::table! {
    context_epoch (session_id) {
        session_id -> Text,
        epoch -> BigInt,
        baseline_seq -> BigInt,
        system -> Text,
        effective_system -> Text,
    }
}

diesel::table! {
    node (owner_id) {
        owner_id -> Text,
        host -> Text,
        pid -> BigInt,
        started_at -> BigInt,
        heartbeat_at -> BigInt,
    }
}

// One row (`id` 1): how many sessions are not deleted, kept by the projector.
diesel::table! {
    session_count (id) {
        id -> Integer,
        live -> BigInt,
    }
}

diesel::joinable!(event -> session (session_id));
diesel::joinable!(session_message -> session (session_id));
diesel::joinable!(session_input -> session (session_id));
diesel::joinable!(session_request -> session (session_id));
diesel::allow_tables_to_appear_in_same_query!(
    session,
    event,
    session_message,
    session_tool,
    session_input,
    session_execution,
    session_request,
    context_epoch,
    node,
    session_count,
);
