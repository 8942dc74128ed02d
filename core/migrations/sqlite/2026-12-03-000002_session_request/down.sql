DROP INDEX session_request_open_idx;
DROP INDEX session_request_call_idx;
DROP TABLE session_request;
