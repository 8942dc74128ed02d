-- A context epoch's system prompt, fixed for the epoch, and the effective one (the
-- epoch's, or the last `context.system_updated` since). Sessions from before epochs have
-- no row: their next step starts epoch 1.
ALTER TABLE context_epoch ADD COLUMN system TEXT NOT NULL DEFAULT '';
ALTER TABLE context_epoch ADD COLUMN effective_system TEXT NOT NULL DEFAULT '';

-- `context.system_updated` projects a message of role 'system'.
ALTER TABLE session_message DROP CONSTRAINT session_message_role_check;
ALTER TABLE session_message ADD CONSTRAINT session_message_role_check
    CHECK (role IN ('user', 'assistant', 'synthetic', 'summary', 'system'));
