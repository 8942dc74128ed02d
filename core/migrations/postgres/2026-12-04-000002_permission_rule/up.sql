-- What a permission request asked about (`pattern`: the command or path) and the pattern
-- of the rule that asked (`rule`), so an `always` answer allows what that rule matches,
-- or only the same pattern again when no rule pattern asked.
ALTER TABLE session_request ADD COLUMN pattern TEXT NOT NULL DEFAULT '';
ALTER TABLE session_request ADD COLUMN rule TEXT;

-- Before rules, an `always` answer allowed the whole tool; requests asked then keep that.
UPDATE session_request
SET pattern = COALESCE((
        SELECT event.data::jsonb ->> 'pattern' FROM event
        WHERE event.session_id = session_request.session_id
          AND event.seq = session_request.asked_seq
    ), ''),
    rule = '*'
WHERE kind = 'permission';
