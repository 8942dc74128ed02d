DELETE FROM session_message WHERE role = 'system';
ALTER TABLE session_message DROP CONSTRAINT session_message_role_check;
ALTER TABLE session_message ADD CONSTRAINT session_message_role_check
    CHECK (role IN ('user', 'assistant', 'synthetic', 'summary'));

ALTER TABLE context_epoch DROP COLUMN effective_system;
ALTER TABLE context_epoch DROP COLUMN system;
