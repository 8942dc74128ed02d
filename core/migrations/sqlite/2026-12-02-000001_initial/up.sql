-- Keel's initial schema (SQLite). Keep in step with migrations/postgres.
-- Times are milliseconds since the Unix epoch; JSON is stored as text.

CREATE TABLE session (
    id                TEXT PRIMARY KEY NOT NULL,
    title             TEXT,
    directory         TEXT NOT NULL,
    agent             TEXT NOT NULL,
    model_provider    TEXT NOT NULL,
    model_id          TEXT NOT NULL,
    time_created      BIGINT NOT NULL,
    time_updated      BIGINT NOT NULL,
    -- The seq of the latest event: the log's counter, and max(event.seq) by construction.
    last_seq          BIGINT NOT NULL,
    usage_input       BIGINT NOT NULL,
    usage_output      BIGINT NOT NULL,
    usage_reasoning   BIGINT NOT NULL,
    usage_cache_read  BIGINT NOT NULL,
    usage_cache_write BIGINT NOT NULL,
    cost              DOUBLE PRECISION NOT NULL,
    deleted_at        BIGINT
);
CREATE INDEX session_created_idx ON session (time_created, id);

CREATE TABLE event (
    session_id TEXT NOT NULL REFERENCES session (id),
    seq        BIGINT NOT NULL CHECK (seq > 0),
    id         TEXT NOT NULL UNIQUE,
    type       TEXT NOT NULL,
    version    INTEGER NOT NULL,
    data       TEXT NOT NULL,
    time       BIGINT NOT NULL,
    PRIMARY KEY (session_id, seq)
);

CREATE TABLE session_message (
    id         TEXT PRIMARY KEY NOT NULL,
    session_id TEXT NOT NULL REFERENCES session (id),
    seq        BIGINT NOT NULL,
    role       TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'synthetic', 'summary')),
    data       TEXT NOT NULL,
    UNIQUE (session_id, seq)
);

CREATE TABLE session_tool (
    session_id        TEXT NOT NULL REFERENCES session (id),
    call_id           TEXT NOT NULL,
    message_id        TEXT NOT NULL REFERENCES session_message (id),
    name              TEXT NOT NULL,
    effect            TEXT CHECK (effect IN ('read', 'write')),
    status            TEXT NOT NULL CHECK (status IN ('pending', 'running', 'completed', 'error')),
    provider_executed BOOLEAN NOT NULL,
    input             TEXT,
    output            TEXT,
    PRIMARY KEY (session_id, call_id)
);
CREATE INDEX session_tool_message_idx ON session_tool (message_id);

CREATE TABLE session_input (
    id                  TEXT PRIMARY KEY NOT NULL,
    session_id          TEXT NOT NULL REFERENCES session (id),
    kind                TEXT NOT NULL CHECK (kind IN ('prompt', 'compact')),
    delivery            TEXT NOT NULL CHECK (delivery IN ('steer', 'queue')),
    parts               TEXT NOT NULL,
    source              TEXT NOT NULL CHECK (source IN ('user', 'synthetic', 'recovery')),
    request_execution   BOOLEAN NOT NULL,
    admitted_seq        BIGINT NOT NULL,
    execution_requested BOOLEAN NOT NULL,
    promoted_seq        BIGINT,
    message_id          TEXT,
    cancelled_seq       BIGINT
);
CREATE INDEX session_input_pending_idx ON session_input (session_id, admitted_seq)
    WHERE promoted_seq IS NULL AND cancelled_seq IS NULL;

CREATE TABLE session_execution (
    id                   TEXT PRIMARY KEY NOT NULL,
    session_id           TEXT NOT NULL UNIQUE REFERENCES session (id),
    owner_id             TEXT NOT NULL,
    assistant_message_id TEXT,
    assistant_seq        BIGINT,
    phase                TEXT NOT NULL CHECK (phase IN ('claimed', 'running', 'compacting', 'cancelling')),
    time_created         BIGINT NOT NULL,
    expires_at           BIGINT NOT NULL,
    recovery_error       TEXT
);
CREATE INDEX session_execution_recovery_scan_idx
    ON session_execution (recovery_error, expires_at, time_created, id);
CREATE INDEX session_execution_owner_idx ON session_execution (owner_id);

CREATE TABLE context_epoch (
    session_id   TEXT PRIMARY KEY NOT NULL REFERENCES session (id),
    epoch        BIGINT NOT NULL,
    baseline_seq BIGINT NOT NULL
);

CREATE TABLE node (
    owner_id     TEXT PRIMARY KEY NOT NULL,
    host         TEXT NOT NULL,
    pid          BIGINT NOT NULL,
    started_at   BIGINT NOT NULL,
    heartbeat_at BIGINT NOT NULL
);
