// Following a session's durable log (`GET /api/session/{id}/log`) as an async iterator
// that owns its reconnects, because only it knows the last seq it handed out:
// - every connection asks for the events after that seq (`Last-Event-ID`), so a dropped
//   connection resumes without losing or repeating an event;
// - a durable event whose seq is not the next one is a gap: the connection is dropped
//   and the missing events are asked for again; a gap that does not heal is an error;
// - the server sends a comment heartbeat (every 15 s by default); a connection silent
//   for `heartbeatTimeoutMs` is presumed dead and replaced;
// - answers Keel gives on purpose (400, 401, 404) end the iterator with a KeelError;
//   a server out of reach is retried with backoff, up to `maxReconnects` failures in a
//   row without an event between them.

import type { components } from "./generated/openapi.js";
import { KeelError, type KeelClient } from "./client.js";
import { serverSentEvents } from "./sse.js";

type Schemas = components["schemas"];

/** A durable event with its envelope: a discriminated union on `type`. */
export type Envelope = Schemas["Envelope"];
/** A live delta (text, reasoning, tool progress): never stored, never replayed. */
export type EphemeralEnvelope = Schemas["EphemeralEnvelope"];
/** The marker between the history and live events. */
export type Synced = Schemas["Synced"];

/** One item of a session's log. */
export type LogItem =
  | { kind: "durable"; event: Envelope }
  | { kind: "ephemeral"; event: EphemeralEnvelope }
  | { kind: "synced"; synced: Synced };

/** How {@link KeelClient.sessionLog} reads the log. */
export interface LogOptions {
  /** Durable events with seq greater than this (default 0: from the start). */
  after?: number;
  /** Keep following live events after `synced` (default true). */
  follow?: boolean;
  /** Interleave ephemeral events (default false). */
  ephemeral?: boolean;
  /** A connection silent this long, heartbeats included, is replaced (default 45 s). */
  heartbeatTimeoutMs?: number;
  /** The wait before the first reconnect; it doubles on each failure (default 250 ms). */
  reconnectDelayMs?: number;
  /** The longest wait between reconnects (default 10 s). */
  maxReconnectDelayMs?: number;
  /** Failed connections in a row, without an event between them, before giving up (10). */
  maxReconnects?: number;
  /** Stops the iterator (it then ends without an error). */
  signal?: AbortSignal;
}

/** How often one gap is asked for again before the iterator reports it. */
const GAP_RETRIES = 3;

/** Statuses Keel sends on purpose for a request that will not succeed if repeated. */
const FINAL = new Set([400, 401, 403, 404, 409, 413, 422]);

export async function* sessionLog(
  client: KeelClient,
  id: string,
  options: LogOptions = {},
): AsyncGenerator<LogItem, void, void> {
  const follow = options.follow ?? true;
  const heartbeatTimeoutMs = options.heartbeatTimeoutMs ?? 45_000;
  const reconnectDelayMs = options.reconnectDelayMs ?? 250;
  const maxReconnectDelayMs = options.maxReconnectDelayMs ?? 10_000;
  const maxReconnects = options.maxReconnects ?? 10;
  const outer = options.signal;
  let last = options.after ?? 0;
  let synced = false;
  let failures = 0;
  let gap: { expected: number; tries: number } | undefined;

  while (!outer?.aborted) {
    const connection = new AbortController();
    const stop = () => connection.abort(outer?.reason);
    outer?.addEventListener("abort", stop, { once: true });
    let lastError: unknown;
    try {
      const url = client.url(`/api/session/${id}/log`, {
        follow,
        include: options.ephemeral ? "ephemeral" : undefined,
      });
      const response = await client.fetch(url, {
        headers: client.headers({
          accept: "text/event-stream",
          "last-event-id": String(last),
        }),
        signal: connection.signal,
      });
      if (!response.ok) {
        const error = await KeelError.from(response);
        if (FINAL.has(response.status)) throw error;
        throw new Retry(error);
      }
      if (!response.body) throw new Retry(new Error("the log answered without a body"));
      for await (const message of serverSentEvents(response.body, connection, heartbeatTimeoutMs)) {
        if (message.event === "synced") {
          if (!synced) {
            synced = true;
            yield { kind: "synced", synced: JSON.parse(message.data) as Synced };
          }
          if (!follow) return;
          continue;
        }
        const data = JSON.parse(message.data) as Record<string, unknown>;
        if (typeof data.seq !== "number") {
          yield { kind: "ephemeral", event: data as EphemeralEnvelope };
          continue;
        }
        const seq = data.seq;
        if (seq <= last) continue; // Already handed out, before a reconnect.
        if (seq !== last + 1) {
          // Events were missed: ask for them again from the last one handed out.
          const tries = gap?.expected === last + 1 ? gap.tries + 1 : 1;
          gap = { expected: last + 1, tries };
          if (gap.tries > GAP_RETRIES) throw new LogGapError(last + 1, seq);
          throw new Retry(new Error(`seq gap: ${last + 1} expected, ${seq} came`), true);
        }
        last = seq;
        failures = 0;
        gap = undefined;
        yield { kind: "durable", event: data as Envelope };
      }
      // The server ended the stream (a restart, say): resume after the last seq.
      lastError = new Error("the log stream ended");
    } catch (error) {
      if (outer?.aborted) return;
      if (error instanceof Retry) {
        if (error.immediate) continue;
        lastError = error.cause;
      } else if (error instanceof KeelError || error instanceof LogGapError || error instanceof SyntaxError) {
        // Keel's own refusal, a gap that does not heal, data that is not JSON: another
        // connection would get the same.
        throw error;
      } else {
        lastError = error;
      }
    } finally {
      outer?.removeEventListener("abort", stop);
      connection.abort();
    }
    failures += 1;
    if (failures > maxReconnects) throw lastError;
    const delay = Math.min(reconnectDelayMs * 2 ** (failures - 1), maxReconnectDelayMs);
    await sleep(delay, outer);
  }
}

/** `GET /api/event`: live events of all sessions, until `lagged` or `signal`. */
export async function* liveEvents(
  client: KeelClient,
  options: { signal?: AbortSignal; heartbeatTimeoutMs?: number } = {},
): AsyncGenerator<Schemas["LiveItem"], void, void> {
  const connection = new AbortController();
  const stop = () => connection.abort(options.signal?.reason);
  options.signal?.addEventListener("abort", stop, { once: true });
  try {
    const response = await client.fetch(client.url("/api/event"), {
      headers: client.headers({ accept: "text/event-stream" }),
      signal: connection.signal,
    });
    if (!response.ok) throw await KeelError.from(response);
    if (!response.body) return;
    const timeout = options.heartbeatTimeoutMs ?? 45_000;
    for await (const message of serverSentEvents(response.body, connection, timeout)) {
      const item = JSON.parse(message.data) as Schemas["LiveItem"];
      yield item;
      if (message.event === "lagged") return;
    }
  } catch (error) {
    if (options.signal?.aborted) return;
    throw error;
  } finally {
    options.signal?.removeEventListener("abort", stop);
    connection.abort();
  }
}

/** A failure worth another connection; `immediate` skips the backoff (a gap). */
class Retry extends Error {
  readonly immediate: boolean;
  constructor(cause: unknown, immediate = false) {
    super("retry", { cause });
    this.immediate = immediate;
  }
}

/** The log skipped from one seq to a later one, and asking again did not fill the gap. */
export class LogGapError extends Error {
  readonly expected: number;
  readonly got: number;
  constructor(expected: number, got: number) {
    super(`the log jumped to seq ${got} when ${expected} was next`);
    this.name = "LogGapError";
    this.expected = expected;
    this.got = got;
  }
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(done, ms);
    function done() {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    }
    signal?.addEventListener("abort", done, { once: true });
  });
}
