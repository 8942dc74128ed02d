ALTER TABLE session_request DROP COLUMN rule;
ALTER TABLE session_request DROP COLUMN pattern;
