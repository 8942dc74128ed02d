// A session's conversation as people read it, built from its log one item at a time.
//
// Durable events are applied once each, in seq order: an event at or below the last seq
// applied is skipped, so a reconnect that repeats history adds nothing. Every element a
// durable event creates carries its seq in `data-seq` (what the browser tests count).
// Ephemeral deltas only grow the fragment they belong to; the fragment's durable end
// replaces what they showed with the whole text, so a delta lost to a reconnect leaves
// no trace once the fragment ends. A delta may arrive before its fragment's start (Keel
// publishes deltas without waiting for that start's commit): its text is kept until the
// start arrives and shown from there.

import type { Envelope, EphemeralEnvelope, KeelClient, Schemas } from "../../clients/typescript/src/index.js";
import { append, button, count, h } from "./dom.js";
import { markdown } from "./markdown.js";

type Data<T extends Envelope["type"]> = Extract<Envelope, { type: T }>["data"];

interface Fragment {
  element: HTMLElement;
  text: string;
  /** Its `*.ended` was applied: the text is final, and a late delta changes nothing. */
  ended: boolean;
}

interface ToolCard {
  card: HTMLElement;
  state: HTMLElement;
  body: HTMLElement;
  output?: HTMLPreElement;
}

/** Fragments whose deltas arrived before their start, at most (the oldest is dropped). */
const EARLY_FRAGMENTS = 16;

/** Longest tool output shown before "show all". */
const OUTPUT_PREVIEW = 4000;

export class Conversation {
  readonly element: HTMLElement;
  private readonly client: KeelClient;
  private readonly sessionId: string;
  private lastSeq = 0;
  private readonly steps = new Map<string, HTMLElement>();
  private readonly fragments = new Map<string, Fragment>();
  /** Text of deltas whose fragment has not started yet, by fragment. */
  private readonly early = new Map<string, string>();
  private readonly tools = new Map<string, ToolCard>();
  private readonly inputs = new Map<string, HTMLElement>();
  private readonly requests = new Map<string, HTMLElement>();
  private compaction: HTMLElement | undefined;

  constructor(client: KeelClient, sessionId: string) {
    this.client = client;
    this.sessionId = sessionId;
    this.element = h("div", { class: "conversation", "data-last-seq": 0 });
  }

  /** The seq of the last durable event applied. */
  get seq(): number {
    return this.lastSeq;
  }

  /** Applies a durable event, once: an event already applied is skipped. */
  apply(event: Envelope): void {
    if (event.seq <= this.lastSeq) return;
    this.lastSeq = event.seq;
    this.element.dataset.lastSeq = String(event.seq);
    this.render(event);
  }

  /** Applies a live delta to the fragment or call it belongs to. */
  live(event: EphemeralEnvelope): void {
    switch (event.type) {
      case "session.next.text.delta":
      case "session.next.reasoning.delta": {
        const kind = event.type === "session.next.text.delta" ? "text" : "reasoning";
        const id = key(event.data.assistant_message_id, event.data.ordinal, kind);
        const fragment = this.fragments.get(id);
        if (!fragment) {
          this.keepEarly(id, event.data.delta);
          return;
        }
        // A delta can reach the page after its fragment's end: the stream sends the log
        // from the database when it catches up, and the delta published before that end
        // only afterwards. The ended text is the truth.
        if (fragment.ended) return;
        fragment.text += event.data.delta;
        fragment.element.textContent = fragment.text;
        fragment.element.classList.add("streaming");
        return;
      }
      case "session.next.tool.progress": {
        const tool = this.tools.get(event.data.call_id);
        const metadata = event.data.metadata as { output?: unknown } | null;
        if (!tool || typeof metadata?.output !== "string") return;
        tool.output ??= tool.body.appendChild(h("pre", { class: "output live" }));
        tool.output.textContent = tail((tool.output.textContent ?? "") + metadata.output);
        return;
      }
      case "session.next.compaction.delta":
        if (this.compaction) this.compaction.textContent = tail((this.compaction.textContent ?? "") + event.data.text);
        return;
      default:
        return;
    }
  }

  private render(event: Envelope): void {
    switch (event.type) {
      case "session.next.prompt.admitted":
        return this.admitted(event.seq, event.data);
      case "session.next.prompted":
        this.inputs.get(event.data.input_id)?.classList.remove("pending");
        return;
      case "session.next.prompt.cancelled": {
        const input = this.inputs.get(event.data.input_id);
        input?.classList.replace("pending", "cancelled");
        input?.append(h("span", { class: "badge" }, "cancelled"));
        return;
      }
      case "session.next.synthetic":
        return this.add(event.seq, h("div", { class: "note" }, `Keel: ${event.data.text}`));
      case "session.next.step.started":
        return this.stepStarted(event.seq, event.data);
      case "session.next.text.started":
        return this.fragmentStarted(event.seq, event.data.assistant_message_id, event.data.ordinal, "text");
      case "session.next.text.ended":
        return this.fragmentEnded(event.data.assistant_message_id, event.data.ordinal, "text", event.data.text);
      case "session.next.reasoning.started":
        return this.fragmentStarted(event.seq, event.data.assistant_message_id, event.data.ordinal, "reasoning");
      case "session.next.reasoning.ended":
        return this.fragmentEnded(event.data.assistant_message_id, event.data.ordinal, "reasoning", event.data.text);
      case "session.next.tool.called":
        return this.toolCalled(event.seq, event.data);
      case "session.next.tool.success":
        return this.toolSucceeded(event.data);
      case "session.next.tool.failed": {
        const tool = this.tools.get(event.data.call_id);
        if (!tool) return;
        this.toolState(tool, "failed");
        tool.body.append(h("div", { class: "error" }, event.data.error.message));
        return;
      }
      case "session.next.permission.requested":
        return this.permissionRequested(event.seq, event.data);
      case "session.next.permission.replied": {
        const call = this.requests.get(event.data.request_id)?.closest<HTMLElement>(".tool-call")?.dataset.call;
        const tool = call ? this.tools.get(call) : undefined;
        if (tool && event.data.decision !== "reject") this.toolState(tool, "running");
        return this.replied(event.data.request_id, DECISIONS[event.data.decision]);
      }
      case "session.next.question.asked":
        return this.questionAsked(event.seq, event.data);
      case "session.next.question.answered":
        return this.replied(event.data.request_id, `Answered: ${event.data.answer}`);
      case "session.next.question.dismissed":
        return this.replied(event.data.request_id, "Dismissed");
      case "session.next.step.ended": {
        const { usage, cost, finish } = event.data;
        const text = `${count(usage.input)} in · ${count(usage.output)} out${cost ? ` · $${cost.toFixed(4)}` : ""}`;
        this.footer(event.seq, event.data.assistant_message_id, finish === "stop" ? text : `${text} · ${finish}`);
        return;
      }
      case "session.next.step.awaiting":
        return this.footer(event.seq, event.data.assistant_message_id, "waiting for a reply");
      case "session.next.step.failed":
        return this.add(event.seq, h("div", { class: "error" }, `The step failed: ${event.data.error.message}`));
      case "session.next.step.interrupted":
        return this.marker(event.seq, `Interrupted (${INTERRUPTS[event.data.reason]})`, "interrupted");
      case "session.next.step.recovered": {
        const rerun = event.data.rerun?.length ?? 0;
        return this.marker(
          event.seq,
          `Recovered: the process running this step stopped; another took over${rerun ? `, re-running ${rerun} call${rerun > 1 ? "s" : ""}` : ""}`,
          "recovered",
        );
      }
      case "session.next.retry.scheduled":
        return this.marker(
          event.seq,
          `The provider failed (${event.data.error.message}); retry ${event.data.attempt} scheduled`,
          "retry",
        );
      case "session.next.execution.settled":
        if (event.data.error) {
          this.add(event.seq, h("div", { class: "error" }, event.data.error.message));
        } else if (event.data.outcome === "recovered") {
          this.marker(event.seq, "The execution was recovered", "recovered");
        }
        return;
      case "session.next.compaction.started":
        this.compaction = h("pre", { class: "output live" });
        this.add(
          event.seq,
          h("details", { class: "marker compaction" }, h("summary", {}, `Compacting history (${event.data.reason})…`), this.compaction),
        );
        return;
      case "session.next.compaction.ended": {
        const details = h("details", { class: "marker compaction" }, h("summary", {}, "History compacted: the summary"));
        details.append(h("div", { class: "markdown" }, markdown(event.data.summary)));
        this.compaction = undefined;
        return this.add(event.seq, details);
      }
      case "session.next.compaction.failed":
        this.compaction = undefined;
        return this.add(event.seq, h("div", { class: "error" }, `Compaction failed: ${event.data.error.message}`));
      case "session.next.renamed":
        return this.marker(event.seq, `Renamed “${event.data.title}”`);
      case "session.next.model.switched":
        return this.marker(event.seq, `Model: ${event.data.model.provider}/${event.data.model.id}`);
      case "session.next.agent.switched":
        return this.marker(event.seq, `Agent: ${event.data.agent}`);
      case "session.next.deleted":
        return this.marker(event.seq, "This session was deleted");
      default:
        return;
    }
  }

  private add(seq: number, element: HTMLElement, parent: HTMLElement = this.element): void {
    element.dataset.seq = String(seq);
    parent.append(element);
  }

  private marker(seq: number, text: string, kind = ""): void {
    this.add(seq, h("div", { class: `marker ${kind}`.trim() }, text));
  }

  private admitted(seq: number, data: Data<"session.next.prompt.admitted">): void {
    if (data.kind === "compact") {
      return this.marker(seq, "Compaction requested");
    }
    const message = h("div", { class: "message user pending" });
    for (const part of data.parts) {
      if (part.type === "text") message.append(h("div", { class: "text" }, part.text));
      else message.append(h("div", { class: "file" }, `📎 ${part.filename ?? part.url}`));
    }
    if (data.delivery === "steer") message.append(h("span", { class: "badge" }, "steer"));
    this.inputs.set(data.input_id, message);
    this.add(seq, message);
  }

  private stepStarted(seq: number, data: Data<"session.next.step.started">): void {
    const step = h(
      "div",
      { class: "message assistant", "data-message": data.assistant_message_id },
      h("div", { class: "meta" }, `${data.agent} · ${data.model.provider}/${data.model.id} · step ${data.step}`),
    );
    this.steps.set(data.assistant_message_id, step);
    this.add(seq, step);
  }

  /** The step `message` belongs to; a step whose start is missing gets one. */
  private step(message: string): HTMLElement {
    let step = this.steps.get(message);
    if (!step) {
      step = h("div", { class: "message assistant", "data-message": message });
      this.steps.set(message, step);
      this.element.append(step);
    }
    return step;
  }

  private fragmentStarted(seq: number, message: string, ordinal: number, kind: "text" | "reasoning"): void {
    const body = h("div", { class: kind === "text" ? "text markdown" : "reasoning-text" });
    const element = kind === "text" ? body : h("details", { class: "reasoning" }, h("summary", {}, "Reasoning"), body);
    const id = key(message, ordinal, kind);
    const text = this.early.get(id) ?? "";
    this.early.delete(id);
    if (text) {
      body.textContent = text;
      body.classList.add("streaming");
    }
    this.fragments.set(id, { element: body, text, ended: false });
    this.add(seq, element, this.step(message));
  }

  /** Keeps a delta of fragment `id`, not started yet, for its start. */
  private keepEarly(id: string, delta: string): void {
    const text = (this.early.get(id) ?? "") + delta;
    this.early.delete(id);
    this.early.set(id, text);
    if (this.early.size > EARLY_FRAGMENTS) {
      const oldest = this.early.keys().next().value;
      if (oldest !== undefined) this.early.delete(oldest);
    }
  }

  private fragmentEnded(message: string, ordinal: number, kind: "text" | "reasoning", text: string): void {
    const fragment = this.fragments.get(key(message, ordinal, kind));
    if (!fragment) return;
    fragment.text = text;
    fragment.ended = true;
    fragment.element.classList.remove("streaming");
    fragment.element.replaceChildren(kind === "text" ? markdown(text) : text);
  }

  private toolCalled(seq: number, data: Data<"session.next.tool.called">): void {
    const state = h("span", { class: "state running" }, "running");
    const body = h("div", { class: "tool-body" }, toolInput(data.name, data.input));
    const card = h(
      "div",
      { class: "tool-call", "data-call": data.call_id, "data-tool": data.name },
      h("div", { class: "tool-head" }, h("span", { class: "tool-name" }, data.name), h("span", { class: `effect ${data.effect}` }, data.effect), state),
      body,
    );
    this.tools.set(data.call_id, { card, state, body });
    this.add(seq, card, this.step(data.assistant_message_id));
  }

  private toolState(tool: ToolCard, state: "running" | "waiting" | "done" | "failed"): void {
    tool.state.className = `state ${state}`;
    tool.state.textContent = state === "waiting" ? "waiting for permission" : state;
    if (state === "done" || state === "failed") tool.output?.classList.remove("live");
  }

  private toolSucceeded(data: Data<"session.next.tool.success">): void {
    const tool = this.tools.get(data.call_id);
    if (!tool) return;
    this.toolState(tool, "done");
    tool.output?.remove();
    tool.output = undefined;
    for (const content of data.content) {
      if (content.type === "text") {
        tool.body.append(output(content.text));
      } else if (/^image\/(png|jpeg|gif|webp)$/.test(content.mime)) {
        tool.body.append(h("img", { class: "media", alt: "tool output", src: `data:${content.mime};base64,${content.data}` }));
      } else {
        tool.body.append(h("div", { class: "file" }, `${content.mime}, ${count(Math.floor((content.data.length * 3) / 4))} bytes`));
      }
    }
  }

  private permissionRequested(seq: number, data: Data<"session.next.permission.requested">): void {
    const prompt = h(
      "div",
      { class: "request permission", "data-request": data.request_id },
      h("div", {}, `Allow ${data.tool} `, h("code", {}, data.pattern), "?"),
    );
    const choices = h("div", { class: "choices" });
    const reply = (decision: Schemas["Decision"]) => () =>
      this.send(choices, () => this.client.replyPermission(this.sessionId, data.request_id, { decision }));
    choices.append(
      button("Allow once", reply("once"), { class: "primary" }),
      button("Always allow", reply("always")),
      button("Reject", reply("reject"), { class: "danger" }),
    );
    prompt.append(choices);
    this.requests.set(data.request_id, prompt);
    const tool = this.tools.get(data.call_id);
    if (tool) this.toolState(tool, "waiting");
    this.add(seq, prompt, tool?.body ?? this.element);
  }

  private questionAsked(seq: number, data: Data<"session.next.question.asked">): void {
    const prompt = h("div", { class: "request question", "data-request": data.request_id }, h("div", { class: "markdown" }, markdown(data.question)));
    const choices = h("div", { class: "choices" });
    const answer = (body: Schemas["QuestionReply"]) =>
      this.send(choices, () => this.client.replyQuestion(this.sessionId, data.request_id, body));
    for (const option of data.options ?? []) {
      choices.append(button(option, () => answer({ answer: option })));
    }
    const field = h("input", { type: "text", placeholder: "Your answer", "aria-label": "Your answer" });
    const form = h("form", { class: "answer" }, field, h("button", { type: "submit", class: "primary" }, "Answer"));
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      if (field.value.trim()) answer({ answer: field.value });
    });
    choices.append(form, button("Dismiss", () => answer({ dismiss: true }), { class: "danger" }));
    prompt.append(choices);
    this.requests.set(data.request_id, prompt);
    this.add(seq, prompt, this.tools.get(data.call_id)?.body ?? this.element);
  }

  /** Sends a reply from `choices`, disabled meanwhile; its event then records the answer. */
  private send(choices: HTMLElement, reply: () => Promise<unknown>): void {
    const controls = choices.querySelectorAll<HTMLButtonElement | HTMLInputElement>("button, input");
    controls.forEach((c) => (c.disabled = true));
    choices.querySelector(".error")?.remove();
    reply().catch((error: unknown) => {
      controls.forEach((c) => (c.disabled = false));
      choices.append(h("div", { class: "error" }, String(error instanceof Error ? error.message : error)));
    });
  }

  private replied(request: string, text: string): void {
    const prompt = this.requests.get(request);
    if (!prompt) return;
    prompt.querySelector(".choices")?.remove();
    prompt.classList.add("answered");
    prompt.append(h("div", { class: "reply" }, text));
  }

  private footer(seq: number, message: string, text: string): void {
    this.add(seq, h("div", { class: "meta footer" }, text), this.step(message));
  }
}

const DECISIONS: Record<Schemas["Decision"], string> = {
  once: "Allowed once",
  always: "Always allowed",
  reject: "Rejected",
};

const INTERRUPTS: Record<Schemas["InterruptReason"], string> = {
  user: "by a person",
  shutdown: "the server shut down",
  permission_rejected: "a permission was rejected",
  question_dismissed: "a question was dismissed",
};

function key(message: string, ordinal: number, kind: string): string {
  return `${message}/${ordinal}/${kind}`;
}

/** The last part of a growing output, so a long command does not grow the page forever. */
function tail(text: string): string {
  return text.length > 20_000 ? text.slice(-20_000) : text;
}

/** A tool's output: the start shown, the rest behind "show all". */
function output(text: string): HTMLElement {
  if (text.length <= OUTPUT_PREVIEW) return h("pre", { class: "output" }, text);
  const pre = h("pre", { class: "output" }, `${text.slice(0, OUTPUT_PREVIEW)}…`);
  const more = button(`Show all ${count(text.length)} characters`, () => {
    pre.textContent = text;
    more.remove();
  });
  return h("div", {}, pre, more);
}

/** A tool call's input as people read it: a diff for `edit` and `write`, the command for `bash`. */
function toolInput(name: string, input: unknown): HTMLElement {
  const fields = (input ?? {}) as Record<string, unknown>;
  const text = (field: string) => (typeof fields[field] === "string" ? (fields[field] as string) : undefined);
  const path = text("path");
  if (name === "edit" && path !== undefined && text("old") !== undefined && text("new") !== undefined) {
    return diff(path, text("old")!, text("new")!);
  }
  if (name === "write" && path !== undefined && text("content") !== undefined) {
    return diff(path, "", text("content")!);
  }
  if (name === "bash" && text("command") !== undefined) {
    return h("pre", { class: "command" }, `$ ${text("command")}`);
  }
  return h("pre", { class: "input" }, JSON.stringify(input, null, 2));
}

/** `before` → `after` of `path` as removed and added lines (their common ends kept as context). */
function diff(path: string, before: string, after: string): HTMLElement {
  const lines = (text: string) => (text === "" ? [] : text.replace(/\n$/, "").split("\n"));
  const old = lines(before);
  const next = lines(after);
  let start = 0;
  while (start < old.length && start < next.length && old[start] === next[start]) start++;
  let end = 0;
  while (end < old.length - start && end < next.length - start && old[old.length - 1 - end] === next[next.length - 1 - end]) end++;
  const view = h("pre", { class: "diff" });
  const line = (kind: string, prefix: string, text: string) => append(view, h("span", { class: kind }, `${prefix}${text}\n`));
  old.slice(0, start).forEach((l) => line("context", "  ", l));
  old.slice(start, old.length - end).forEach((l) => line("removed", "- ", l));
  next.slice(start, next.length - end).forEach((l) => line("added", "+ ", l));
  old.slice(old.length - end).forEach((l) => line("context", "  ", l));
  return h("div", { class: "diff-view" }, h("div", { class: "path" }, path), view);
}
