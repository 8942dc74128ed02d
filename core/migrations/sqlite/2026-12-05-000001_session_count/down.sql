DROP TABLE session_count;
