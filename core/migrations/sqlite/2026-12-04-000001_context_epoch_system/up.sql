-- A context epoch's system prompt, fixed for the epoch, and the effective one (the
-- epoch's, or the last `context.system_updated` since). Sessions from before epochs have
-- no row: their next step starts epoch 1.
ALTER TABLE context_epoch ADD COLUMN system TEXT NOT NULL DEFAULT '';
ALTER TABLE context_epoch ADD COLUMN effective_system TEXT NOT NULL DEFAULT '';

-- `context.system_updated` projects a message of role 'system'. SQLite cannot change a
-- CHECK constraint in place, so the table is rebuilt. `session_tool` references it: the
-- check of that reference waits for the end of the transaction, when every message is
-- back under the same id.
PRAGMA defer_foreign_keys = ON;
CREATE TABLE session_message_copy AS SELECT * FROM session_message;
DROP INDEX session_message_updated_idx;
DROP TABLE session_message;
CREATE TABLE session_message (
    id          TEXT PRIMARY KEY NOT NULL,
    session_id  TEXT NOT NULL REFERENCES session (id),
    seq         BIGINT NOT NULL,
    role        TEXT NOT NULL
        CHECK (role IN ('user', 'assistant', 'synthetic', 'summary', 'system')),
    data        TEXT NOT NULL,
    updated_seq BIGINT NOT NULL DEFAULT 0,
    UNIQUE (session_id, seq)
);
INSERT INTO session_message (id, session_id, seq, role, data, updated_seq)
SELECT id, session_id, seq, role, data, updated_seq FROM session_message_copy;
DROP TABLE session_message_copy;
CREATE INDEX session_message_updated_idx ON session_message (session_id, updated_seq);
