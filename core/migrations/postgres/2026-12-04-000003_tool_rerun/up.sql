-- Whether a call may run again, once, after a crash cut it off (`tool.called` version 2's
-- `rerun`): its tool only reads, or is idempotent. Calls from before were never run again.
ALTER TABLE session_tool ADD COLUMN rerun BOOLEAN NOT NULL DEFAULT FALSE;
