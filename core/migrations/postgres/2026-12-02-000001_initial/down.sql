DROP TABLE node;
DROP TABLE context_epoch;
DROP TABLE session_execution;
DROP TABLE session_input;
DROP TABLE session_tool;
DROP TABLE session_message;
DROP TABLE event;
DROP TABLE session;
