ALTER TABLE session_tool DROP COLUMN rerun;
