DROP INDEX session_message_updated_idx;
ALTER TABLE session_message DROP COLUMN updated_seq;
