// The client: one method per route of contracts/openapi.json, typed by the generated
// `components`, over the platform's `fetch` (Node 20+ and browsers alike).

import type { components, paths } from "./generated/openapi.js";
import { liveEvents, sessionLog, type LogItem, type LogOptions } from "./log.js";

/** The API's types, as generated from the contract. */
export type Schemas = components["schemas"];
export type Session = Schemas["Session"];
export type SessionId = Schemas["SessionId"];
export type RequestId = Schemas["RequestId"];
export type ErrorType = Schemas["ErrorType"];

/** How to reach a Keel server. */
export interface ClientOptions {
  /** The bearer token (`keel serve --token`). */
  token?: string;
  /** The `fetch` to use; the platform's by default. */
  fetch?: typeof fetch;
}

/** An error answer from Keel: its status and the error body's `type` and `message`. */
export class KeelError extends Error {
  readonly status: number;
  readonly type: ErrorType | undefined;

  constructor(status: number, type: ErrorType | undefined, message: string) {
    super(`keel answered ${status}${type ? ` (${type})` : ""}: ${message}`);
    this.name = "KeelError";
    this.status = status;
    this.type = type;
  }

  /** The error an answer carries; a body Keel did not write is kept as the message. */
  static async from(response: Response): Promise<KeelError> {
    const text = await response.text().catch(() => "");
    try {
      const body = JSON.parse(text) as Schemas["ErrorBody"];
      return new KeelError(response.status, body.error.type, body.error.message);
    } catch {
      return new KeelError(response.status, undefined, text || response.statusText);
    }
  }
}

type Method = "GET" | "POST" | "PATCH" | "DELETE";
type Query = Record<string, string | number | boolean | null | undefined>;

/** A client for one Keel server. */
export class KeelClient {
  readonly baseUrl: string;
  readonly token: string | undefined;
  readonly fetch: typeof fetch;

  /** A client for the server at `baseUrl`, e.g. `http://127.0.0.1:4096`. */
  constructor(baseUrl: string, options: ClientOptions = {}) {
    if (!/^https?:\/\//.test(baseUrl)) {
      throw new TypeError(`${baseUrl} is not an http:// or https:// URL`);
    }
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.token = options.token;
    // Called unbound, a browser's fetch throws "Illegal invocation".
    this.fetch = options.fetch ?? ((input, init) => globalThis.fetch(input, init));
  }

  /** The URL of `path` with `query`'s set values. */
  url(path: string, query: Query = {}): string {
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query)) {
      if (value !== undefined && value !== null) params.set(key, String(value));
    }
    const search = params.toString();
    return `${this.baseUrl}${path}${search ? `?${search}` : ""}`;
  }

  /** Headers every request carries. */
  headers(extra: Record<string, string> = {}): Record<string, string> {
    return this.token ? { authorization: `Bearer ${this.token}`, ...extra } : { ...extra };
  }

  private async call<T>(
    method: Method,
    path: string,
    options: { query?: Query; body?: unknown; headers?: Record<string, string> } = {},
  ): Promise<T> {
    const headers = this.headers(options.headers);
    const init: RequestInit = { method, headers };
    if (options.body !== undefined) {
      headers["content-type"] = "application/json";
      init.body = JSON.stringify(options.body);
    }
    const response = await this.fetch(this.url(path, options.query), init);
    if (!response.ok) throw await KeelError.from(response);
    if (response.status === 204) return undefined as T;
    return (await response.json()) as T;
  }

  // One method per route, in the contract's order.

  /** `GET /api/health`: whether the server is up, and its version. */
  health(): Promise<Schemas["Health"]> {
    return this.call("GET", "/api/health");
  }

  /** `GET /api/ready`: whether the database, the writer and the node bus answer. */
  ready(): Promise<Schemas["Ready"]> {
    return this.call("GET", "/api/ready");
  }

  /**
   * `POST /api/login`: in a browser, exchanges the token for a read cookie that
   * authenticates GET requests (the event streams among them) without the token in a
   * URL. Writes still send the token.
   */
  login(token: string): Promise<void> {
    return this.call("POST", "/api/login", { body: { token } satisfies Schemas["LoginRequest"] });
  }

  /** `POST /api/logout`: clears the read cookie. */
  logout(): Promise<void> {
    return this.call("POST", "/api/logout");
  }

  /** `POST /api/session`. */
  createSession(body: Schemas["CreateSession"] = {}): Promise<Session> {
    return this.call("POST", "/api/session", { body });
  }

  /** `GET /api/session`: newest first, a page at a time. */
  listSessions(
    query: NonNullable<paths["/api/session"]["get"]["parameters"]["query"]> = {},
  ): Promise<Schemas["SessionList"]> {
    return this.call("GET", "/api/session", { query });
  }

  /** `GET /api/session/{id}`. */
  getSession(id: SessionId): Promise<Session> {
    return this.call("GET", `/api/session/${id}`);
  }

  /** `PATCH /api/session/{id}`: rename, or switch agent or model. */
  updateSession(id: SessionId, body: Schemas["UpdateSession"]): Promise<Session> {
    return this.call("PATCH", `/api/session/${id}`, { body });
  }

  /** `DELETE /api/session/{id}`; its log is kept. */
  deleteSession(id: SessionId): Promise<void> {
    return this.call("DELETE", `/api/session/${id}`);
  }

  /** `GET /api/session/{id}/status`. */
  sessionStatus(id: SessionId): Promise<Schemas["SessionStatus"]> {
    return this.call("GET", `/api/session/${id}/status`);
  }

  /**
   * `POST /api/session/{id}/prompt`. Retrying with the same `idempotencyKey` (or body
   * `id`) and content returns the original admission.
   */
  prompt(
    id: SessionId,
    body: Schemas["PromptRequest"],
    options: { idempotencyKey?: string } = {},
  ): Promise<Schemas["PromptResponse"]> {
    const headers: Record<string, string> = options.idempotencyKey
      ? { "idempotency-key": options.idempotencyKey }
      : {};
    return this.call("POST", `/api/session/${id}/prompt`, { body, headers });
  }

  /** `POST /api/session/{id}/interrupt`: returns before cleanup finishes. */
  interrupt(id: SessionId): Promise<Schemas["InterruptResponse"]> {
    return this.call("POST", `/api/session/${id}/interrupt`);
  }

  /** `POST /api/session/{id}/resume`: start an execution, or join the running one. */
  resume(id: SessionId): Promise<Schemas["SessionStatus"]> {
    return this.call("POST", `/api/session/${id}/resume`);
  }

  /** `POST /api/session/{id}/compact`. */
  compact(id: SessionId): Promise<Schemas["PromptResponse"]> {
    return this.call("POST", `/api/session/${id}/compact`);
  }

  /** `POST /api/session/{id}/permission/{request_id}`: once, always, or reject. */
  replyPermission(
    id: SessionId,
    requestId: RequestId,
    body: Schemas["PermissionReply"],
  ): Promise<Schemas["Accepted"]> {
    return this.call("POST", `/api/session/${id}/permission/${requestId}`, { body });
  }

  /** `POST /api/session/{id}/question/{request_id}`: an answer, or a dismissal. */
  replyQuestion(
    id: SessionId,
    requestId: RequestId,
    body: Schemas["QuestionReply"],
  ): Promise<Schemas["Accepted"]> {
    return this.call("POST", `/api/session/${id}/question/${requestId}`, { body });
  }

  /** `GET /api/session/{id}/messages`: the projected transcript. */
  messages(id: SessionId): Promise<Schemas["MessageList"]> {
    return this.call("GET", `/api/session/${id}/messages`);
  }

  /**
   * `GET /api/session/{id}/log`: the durable log as an async iterator that resumes with
   * `Last-Event-ID`, heals seq gaps and replaces a connection whose heartbeats stop. See
   * {@link LogOptions}.
   */
  sessionLog(id: SessionId, options: LogOptions = {}): AsyncGenerator<LogItem, void, void> {
    return sessionLog(this, id, options);
  }

  /**
   * `GET /api/event`: live events of all sessions, until the server says the reader fell
   * behind (`lagged`, the last item) or `signal` stops it. No history, no resume.
   */
  events(options: { signal?: AbortSignal } = {}): AsyncGenerator<Schemas["LiveItem"], void, void> {
    return liveEvents(this, options);
  }

  /** `GET /api/agents`. */
  agents(): Promise<Schemas["AgentList"]> {
    return this.call("GET", "/api/agents");
  }

  /** `GET /api/mcp`. */
  mcpServers(): Promise<Schemas["McpServerList"]> {
    return this.call("GET", "/api/mcp");
  }

  /** `GET /api/nodes`. */
  nodes(): Promise<Schemas["NodeList"]> {
    return this.call("GET", "/api/nodes");
  }

  /** `GET /openapi.json`: the contract. */
  openapi(): Promise<Record<string, unknown>> {
    return this.call("GET", "/openapi.json");
  }
}
