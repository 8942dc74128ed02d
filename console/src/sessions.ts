// The session list: newest first, each with its live status (idle, busy, waiting for a
// person), kept current by the live event stream of all sessions (`GET /api/event`).
// A status is read again from `GET …/status` when an event that can change it arrives,
// so the list never guesses from events alone; a stream that lags or drops is reopened
// and every status read again.

import { KeelError, type KeelClient, type Session, type Schemas } from "../../clients/typescript/src/index.js";
import { button, h } from "./dom.js";

export type Status = "idle" | "busy" | "waiting" | "stuck";

/** What a status says to people. */
export function status(value: Schemas["SessionStatus"]): Status {
  if (value.execution?.recovery_error) return "stuck";
  if (value.awaiting_replies > 0) return "waiting";
  return value.busy ? "busy" : "idle";
}

export const STATUS_LABEL: Record<Status, string> = {
  idle: "idle",
  busy: "busy",
  waiting: "waiting for you",
  stuck: "needs an operator",
};

/** Event types after which a session's status may have changed. */
export const STATUS_EVENTS = new Set<string>([
  "session.next.execution.started",
  "session.next.execution.settled",
  "session.next.permission.requested",
  "session.next.permission.replied",
  "session.next.question.asked",
  "session.next.question.answered",
  "session.next.question.dismissed",
  "session.next.step.ended",
  "session.next.renamed",
  "session.next.deleted",
]);

interface Row {
  item: HTMLLIElement;
  title: HTMLElement;
  badge: HTMLElement;
}

export class Sessions {
  readonly element: HTMLElement;
  private readonly client: KeelClient;
  private readonly list = h("ul", { class: "sessions" });
  private readonly rows = new Map<string, Row>();
  private readonly pending = new Set<string>();
  private selected: string | undefined;
  private next: string | undefined;
  private readonly more: HTMLButtonElement;

  constructor(client: KeelClient, create: () => void) {
    this.client = client;
    this.more = button("Older sessions", () => void this.page(), { class: "more", hidden: true });
    this.element = h(
      "nav",
      { class: "sidebar", "aria-label": "Sessions" },
      button("New session", create, { class: "primary new-session" }),
      this.list,
      this.more,
    );
  }

  /** Loads the first page, then follows every session's events until `signal` stops. */
  async start(signal: AbortSignal): Promise<void> {
    this.list.replaceChildren();
    this.rows.clear();
    await this.page();
    void this.follow(signal);
  }

  /** Marks `id` as the open session. */
  select(id: string | undefined): void {
    this.selected = id;
    for (const [key, row] of this.rows) row.item.classList.toggle("selected", key === id);
  }

  private async page(): Promise<void> {
    const page = await this.client.listSessions({ limit: 50, ...(this.next ? { cursor: this.next } : {}) });
    for (const session of page.items) this.row(session, "end");
    this.next = page.next_cursor ?? undefined;
    this.more.hidden = !this.next;
    page.items.forEach((session) => this.refresh(session.id));
  }

  private row(session: Session, where: "start" | "end"): void {
    const existing = this.rows.get(session.id);
    if (existing) {
      existing.title.textContent = title(session);
      return;
    }
    const titleElement = h("span", { class: "title" }, title(session));
    const badge = h("span", { class: "status" });
    const item = h(
      "li",
      { "data-session": session.id },
      h("a", { href: `#/session/${session.id}` }, titleElement, badge),
    );
    item.classList.toggle("selected", session.id === this.selected);
    this.rows.set(session.id, { item, title: titleElement, badge });
    if (where === "start") this.list.prepend(item);
    else this.list.append(item);
  }

  /** Reads `id`'s session and status again, soon (several events coalesce). */
  refresh(id: string): void {
    if (this.pending.has(id)) return;
    this.pending.add(id);
    setTimeout(() => {
      this.pending.delete(id);
      void this.read(id);
    }, 50);
  }

  private async read(id: string): Promise<void> {
    try {
      const [session, current] = await Promise.all([this.client.getSession(id), this.client.sessionStatus(id)]);
      this.row(session, "start");
      const row = this.rows.get(id)!;
      const value = status(current);
      row.badge.className = `status ${value}`;
      row.badge.textContent = STATUS_LABEL[value];
    } catch (error) {
      if (error instanceof KeelError && error.status === 404) {
        this.rows.get(id)?.item.remove();
        this.rows.delete(id);
      }
    }
  }

  private async follow(signal: AbortSignal): Promise<void> {
    while (!signal.aborted) {
      try {
        for await (const item of this.client.events({ signal })) {
          if (!("seq" in item)) continue;
          if (item.type === "session.next.created" || STATUS_EVENTS.has(item.type)) this.refresh(item.session_id);
        }
      } catch {
        // Out of reach for now: wait, then reopen.
      }
      if (signal.aborted) return;
      await new Promise((resolve) => setTimeout(resolve, 1000));
      // Events may have been missed meanwhile: read every listed status again.
      for (const id of this.rows.keys()) this.refresh(id);
    }
  }
}

/** A session's name in the list: its title, or when it was created. */
export function title(session: Session): string {
  return session.title || `Session of ${new Date(session.time_created).toLocaleString()}`;
}
