-- Permission requests and questions, one row per request: what the runner resumes a
-- waiting step from, what a reply is checked against, and where an `always` answer is
-- remembered. A projection of the log like the others.
--   state: 'pending' (asked), 'answered' (a reply committed, the call not yet resolved),
--          'settled' (the call is resolved).
--   reply: the reply as JSON once answered.
CREATE TABLE session_request (
    id          TEXT PRIMARY KEY NOT NULL,
    session_id  TEXT NOT NULL REFERENCES session (id),
    call_id     TEXT NOT NULL,
    kind        TEXT NOT NULL CHECK (kind IN ('permission', 'question')),
    tool        TEXT NOT NULL,
    asked_seq   BIGINT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('pending', 'answered', 'settled')),
    reply       TEXT,
    always      BOOLEAN NOT NULL
);
CREATE INDEX session_request_call_idx ON session_request (session_id, call_id);
CREATE INDEX session_request_open_idx ON session_request (session_id, state)
    WHERE state <> 'settled';

-- Requests asked before this table existed were waited on in memory and are settled by
-- now; they are kept so an earlier `always` answer still counts.
INSERT INTO session_request (id, session_id, call_id, kind, tool, asked_seq, state, always)
SELECT json_extract(data, '$.request_id'), session_id, json_extract(data, '$.call_id'),
       'permission', json_extract(data, '$.tool'), seq, 'settled', FALSE
FROM event WHERE type = 'session.next.permission.requested';
INSERT INTO session_request (id, session_id, call_id, kind, tool, asked_seq, state, always)
SELECT json_extract(data, '$.request_id'), session_id, json_extract(data, '$.call_id'),
       'question', 'question', seq, 'settled', FALSE
FROM event WHERE type = 'session.next.question.asked';
UPDATE session_request SET always = TRUE
WHERE id IN (
    SELECT json_extract(data, '$.request_id') FROM event
    WHERE type = 'session.next.permission.replied'
      AND json_extract(data, '$.decision') = 'always'
);
