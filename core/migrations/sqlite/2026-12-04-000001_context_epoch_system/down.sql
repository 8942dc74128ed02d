PRAGMA defer_foreign_keys = ON;
CREATE TABLE session_message_copy AS SELECT * FROM session_message WHERE role <> 'system';
DROP INDEX session_message_updated_idx;
DROP TABLE session_message;
CREATE TABLE session_message (
    id          TEXT PRIMARY KEY NOT NULL,
    session_id  TEXT NOT NULL REFERENCES session (id),
    seq         BIGINT NOT NULL,
    role        TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'synthetic', 'summary')),
    data        TEXT NOT NULL,
    updated_seq BIGINT NOT NULL DEFAULT 0,
    UNIQUE (session_id, seq)
);
INSERT INTO session_message (id, session_id, seq, role, data, updated_seq)
SELECT id, session_id, seq, role, data, updated_seq FROM session_message_copy;
DROP TABLE session_message_copy;
CREATE INDEX session_message_updated_idx ON session_message (session_id, updated_seq);

ALTER TABLE context_epoch DROP COLUMN effective_system;
ALTER TABLE context_epoch DROP COLUMN system;
