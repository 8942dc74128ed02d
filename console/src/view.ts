// One open session: its header (title, model, status, usage), its conversation followed
// live from the durable log, and the prompt box with interrupt.

import { KeelError, type KeelClient, type Schemas } from "../../clients/typescript/src/index.js";
import { Conversation } from "./conversation.js";
import { button, count, h } from "./dom.js";
import { STATUS_EVENTS, STATUS_LABEL, status, title } from "./sessions.js";

/** The wait before a log that failed is opened again. */
const REOPEN_MS = 2000;

export class SessionView {
  readonly element: HTMLElement;
  private readonly client: KeelClient;
  private readonly id: string;
  private readonly conversation: Conversation;
  private readonly stop = new AbortController();
  private readonly onChange: (id: string) => void;
  private readonly heading = h("h2", {});
  private readonly model = h("span", { class: "model" });
  private readonly badge = h("span", { class: "status" });
  private readonly usage = h("span", { class: "usage" });
  private readonly banner = h("div", { class: "banner", hidden: true, role: "status" });
  private readonly scroller: HTMLElement;
  private readonly text = h("textarea", {
    rows: 3,
    placeholder: "Ask for something (Ctrl+Enter sends)",
    "aria-label": "Prompt",
  });
  private readonly delivery = h(
    "select",
    { "aria-label": "Delivery", title: "Queue: after the current work. Steer: at the next step of running work." },
    h("option", { value: "queue" }, "Queue"),
    h("option", { value: "steer" }, "Steer"),
  );
  private readonly sendButton = h("button", { type: "submit", class: "primary" }, "Send");
  private readonly interruptButton: HTMLButtonElement;
  private readonly problem = h("div", { class: "error", hidden: true });
  /** The idempotency key of a prompt not yet admitted, kept so a retry cannot admit it twice. */
  private key: { text: string; value: string } | undefined;
  private refreshing = false;
  private again = false;

  constructor(client: KeelClient, id: string, onChange: (id: string) => void) {
    this.client = client;
    this.id = id;
    this.onChange = onChange;
    this.conversation = new Conversation(client, id);
    this.interruptButton = button("Interrupt", () => void this.interrupt(), { class: "danger", disabled: true });
    this.scroller = h("div", { class: "scroller" }, this.conversation.element);
    const form = h(
      "form",
      { class: "composer" },
      this.text,
      h("div", { class: "actions" }, this.delivery, this.sendButton, this.interruptButton),
      this.problem,
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      void this.send();
    });
    this.text.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
        e.preventDefault();
        void this.send();
      }
    });
    this.element = h(
      "section",
      { class: "session", "data-session": id },
      h("header", { class: "session-head" }, this.heading, h("div", { class: "facts" }, this.model, this.badge, this.usage)),
      this.banner,
      this.scroller,
      form,
    );
  }

  /** Reads the session, then follows its log until {@link close}. */
  async open(): Promise<void> {
    await this.refresh();
    void this.follow();
  }

  close(): void {
    this.stop.abort();
  }

  private async follow(): Promise<void> {
    const signal = this.stop.signal;
    while (!signal.aborted) {
      try {
        const log = this.client.sessionLog(this.id, { after: this.conversation.seq, ephemeral: true, signal });
        for await (const item of log) {
          this.banner.hidden = true;
          const follow = this.atBottom();
          if (item.kind === "durable") {
            this.conversation.apply(item.event);
            if (STATUS_EVENTS.has(item.event.type)) void this.refresh();
          } else if (item.kind === "ephemeral") {
            this.conversation.live(item.event);
          } else {
            this.conversation.element.dataset.synced = "true";
            void this.refresh();
          }
          if (follow) this.scroller.scrollTop = this.scroller.scrollHeight;
        }
      } catch (error) {
        if (signal.aborted) return;
        const final = error instanceof KeelError && [401, 404].includes(error.status);
        this.show(`${final ? "The log cannot be read" : "Reconnecting to the log"}: ${message(error)}`);
        if (final) return;
      }
      await new Promise((resolve) => setTimeout(resolve, REOPEN_MS));
    }
  }

  private atBottom(): boolean {
    return this.scroller.scrollHeight - this.scroller.scrollTop - this.scroller.clientHeight < 80;
  }

  private show(text: string): void {
    this.banner.textContent = text;
    this.banner.hidden = false;
  }

  /** Reads the session and its status again; calls made meanwhile are folded into one more. */
  private async refresh(): Promise<void> {
    if (this.refreshing) {
      this.again = true;
      return;
    }
    this.refreshing = true;
    try {
      do {
        this.again = false;
        const [session, current] = await Promise.all([this.client.getSession(this.id), this.client.sessionStatus(this.id)]);
        this.render(session, current);
      } while (this.again);
      this.onChange(this.id);
    } catch (error) {
      this.show(`The session cannot be read: ${message(error)}`);
    } finally {
      this.refreshing = false;
    }
  }

  private render(session: Schemas["Session"], current: Schemas["SessionStatus"]): void {
    const value = status(current);
    this.heading.textContent = title(session);
    this.model.textContent = `${session.agent} · ${session.model.provider}/${session.model.id}`;
    this.badge.className = `status ${value}`;
    this.badge.textContent = STATUS_LABEL[value];
    const { usage, cost } = current;
    this.usage.textContent = `${count(usage.input)} tokens in · ${count(usage.output)} out${cost ? ` · $${cost.toFixed(4)}` : ""}`;
    this.interruptButton.disabled = !current.busy;
    this.element.dataset.status = value;
  }

  private async send(): Promise<void> {
    const text = this.text.value;
    if (!text.trim() || this.sendButton.disabled) return;
    if (this.key?.text !== text) this.key = { text, value: crypto.randomUUID() };
    this.sendButton.disabled = true;
    this.problem.hidden = true;
    try {
      const delivery = this.delivery.value === "steer" ? "steer" : "queue";
      await this.client.prompt(this.id, { parts: [{ type: "text", text }], delivery }, { idempotencyKey: this.key.value });
      this.key = undefined;
      this.text.value = "";
    } catch (error) {
      this.problem.textContent = `Not sent: ${message(error)}`;
      this.problem.hidden = false;
    } finally {
      this.sendButton.disabled = false;
    }
  }

  private async interrupt(): Promise<void> {
    this.interruptButton.disabled = true;
    try {
      await this.client.interrupt(this.id);
    } catch (error) {
      this.show(`Not interrupted: ${message(error)}`);
      this.interruptButton.disabled = false;
    }
  }
}

export function message(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
