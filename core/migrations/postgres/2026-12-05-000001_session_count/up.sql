-- How many sessions are not deleted, kept by the projector (`session.created` adds one,
-- `session.deleted` takes one away), so that `GET /metrics` reads one row instead of
-- counting the session table at every scrape. Filled from the sessions already there.
CREATE TABLE session_count (
    id INTEGER PRIMARY KEY NOT NULL CHECK (id = 1),
    live BIGINT NOT NULL
);
INSERT INTO session_count (id, live) SELECT 1, COUNT(*) FROM session WHERE deleted_at IS NULL;
