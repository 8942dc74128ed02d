// @keel/client: a typed client for Keel, the durable session engine for AI coding agents.

export { KeelClient, KeelError } from "./client.js";
export type { ClientOptions, Schemas, Session, SessionId, RequestId, ErrorType } from "./client.js";
export { LogGapError, liveEvents } from "./log.js";
export type { LogItem, LogOptions, Envelope, EphemeralEnvelope, Synced } from "./log.js";
export type { components, paths } from "./generated/openapi.js";
