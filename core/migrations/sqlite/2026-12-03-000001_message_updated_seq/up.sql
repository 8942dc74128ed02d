-- The seq of the event that last wrote each message, so a runner can read only the
-- messages that changed since it last looked instead of the whole transcript.
ALTER TABLE session_message ADD COLUMN updated_seq BIGINT NOT NULL DEFAULT 0;
UPDATE session_message
SET updated_seq = COALESCE(
    (SELECT MAX(seq) FROM event WHERE event.session_id = session_message.session_id),
    session_message.seq
);
CREATE INDEX session_message_updated_idx ON session_message (session_id, updated_seq);
