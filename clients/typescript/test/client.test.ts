// @keel/client against a real `keel serve`: a prompt followed to idle, a log connection
// cut mid-stream or stalled (every seq still comes exactly once), an interrupt, a
// permission reply, errors as KeelError, and a method for every operation of the contract.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";

import { KeelClient, KeelError } from "../src/index.js";
import { readUntil, scripted, settled, Server } from "./support.js";

let demo: Server;
// Stops the logs the tests leave open, which would otherwise go on reconnecting to
// stopped servers (with backoff) and keep the process alive.
const closing = new AbortController();
before(async () => {
  demo = await Server.start();
});
after(async () => {
  closing.abort();
  await demo.stop();
});

function contiguous(seqs: number[]): void {
  assert.deepEqual(
    seqs,
    seqs.map((_, i) => i + 1),
    "every seq once, in order",
  );
}

test("a prompt is followed to idle with every event typed and in order", async () => {
  const client = new KeelClient(demo.url);
  const session = await client.createSession();
  const log = client.sessionLog(session.id, { signal: closing.signal });
  await client.prompt(session.id, { parts: [{ type: "text", text: "What is here?" }] });
  const events = await readUntil(log, (e) => settled(e));
  contiguous(events.map((e) => e.seq));
  const called = events.find((e) => e.type === "session.next.tool.called");
  assert.ok(called, "the demo model's tool call is in the log");
  if (called.type === "session.next.tool.called") assert.equal(called.data.name, "list");
  const last = events.at(-1)!;
  assert.ok(settled(last, "succeeded"), JSON.stringify(last));
  const status = await client.sessionStatus(session.id);
  assert.equal(status.busy, false);
});

test("a log connection cut mid-stream resumes with every seq exactly once", async () => {
  let connections = 0;
  // Armed once the first connection has delivered the session's first event: the next
  // chunk it reads (the run's first events, however many the server sent together) is
  // cut in the middle, as a network would, so the run's events arrive on a new
  // connection whatever the chunking.
  let armed = false;
  const cutting: typeof fetch = async (input, init) => {
    const response = await fetch(input, init);
    if (!String(input).includes("/log") || connections++ > 0 || !response.body) return response;
    const reader = response.body.getReader();
    const body = new ReadableStream<Uint8Array>({
      async pull(controller) {
        const { value, done } = await reader.read();
        if (done) {
          controller.close();
        } else if (armed) {
          controller.enqueue(value.subarray(0, Math.floor(value.length / 2)));
          await reader.cancel();
          controller.error(new TypeError("connection reset"));
        } else {
          controller.enqueue(value);
        }
      },
    });
    return new Response(body, { status: response.status, headers: response.headers });
  };
  const client = new KeelClient(demo.url, { fetch: cutting });
  const session = await client.createSession();
  const log = client.sessionLog(session.id, { reconnectDelayMs: 10, signal: closing.signal });
  // Connected (the session's first event read) before the prompt, so the run's events
  // arrive live, after the cut is armed.
  const created = await readUntil(log, (e) => e.type === "session.next.created");
  armed = true;
  await client.prompt(session.id, { parts: [{ type: "text", text: "What is here?" }] });
  const events = [...created, ...(await readUntil(log, (e) => settled(e)))];
  assert.ok(connections >= 2, `the stream reconnected (${connections} connections)`);
  contiguous(events.map((e) => e.seq));
});

// Without the watchdog the stalled read never ends: the timeout fails the test instead.
test("a log connection that stalls is replaced by the heartbeat watchdog", { timeout: 20_000 }, async () => {
  let connections = 0;
  let stalls = 0;
  let stalledAbort: unknown;
  // Every log connection goes through this body, which honours `init.signal` as a real
  // one does. The first chunk of the run (an event with seq 2 or more) is lost, and that
  // connection then stays open but silent: no bytes, no heartbeat. Only an abort ends it.
  const stalling: typeof fetch = async (input, init) => {
    const response = await fetch(input, init);
    if (!String(input).includes("/log") || !response.body) return response;
    const signal = init?.signal;
    if (!signal) throw new Error("the log connection has no signal");
    connections += 1;
    const reader = response.body.getReader();
    let stalled = false;
    let release = () => {};
    const body = new ReadableStream<Uint8Array>({
      start(controller) {
        signal.addEventListener(
          "abort",
          () => {
            if (stalled) stalledAbort = signal.reason;
            reader.cancel(signal.reason).catch(() => {});
            controller.error(signal.reason);
            release();
          },
          { once: true },
        );
      },
      async pull(controller) {
        const { value, done } = await reader.read();
        if (signal.aborted) return; // The stream is errored already.
        if (done) return controller.close();
        const id = /^id: (\d+)$/m.exec(new TextDecoder().decode(value));
        if (stalls === 0 && id && Number(id[1]) >= 2) {
          stalls += 1;
          stalled = true;
          if (!signal.aborted) await new Promise<void>((resolve) => (release = resolve));
          return;
        }
        controller.enqueue(value);
      },
      cancel(reason) {
        return reader.cancel(reason);
      },
    });
    return new Response(body, { status: response.status, headers: response.headers });
  };
  const client = new KeelClient(demo.url, { fetch: stalling });
  const session = await client.createSession();
  const log = client.sessionLog(session.id, { heartbeatTimeoutMs: 300, reconnectDelayMs: 10, signal: closing.signal });
  const created = await readUntil(log, (e) => e.type === "session.next.created");
  await client.prompt(session.id, { parts: [{ type: "text", text: "What is here?" }] });
  const events = [...created, ...(await readUntil(log, (e) => settled(e)))];
  assert.equal(stalls, 1, "a connection stalled in the run");
  assert.ok(stalledAbort instanceof Error, `the stalled connection was aborted (${String(stalledAbort)})`);
  assert.match(stalledAbort.message, /no event or heartbeat/, "by the watchdog");
  assert.ok(connections >= 2, `the stalled connection was replaced (${connections} connections)`);
  contiguous(events.map((e) => e.seq));
  assert.ok(settled(events.at(-1)!, "succeeded"), JSON.stringify(events.at(-1)));
});

test("an interrupt stops a running step and the execution settles interrupted", async () => {
  const server = await Server.start(
    scripted([{ items: [{ type: "text", text: "Thinking." }, { type: "delay", ms: 60000 }] }]),
  );
  try {
    const client = new KeelClient(server.url);
    const session = await client.createSession();
    const log = client.sessionLog(session.id, { signal: closing.signal });
    await client.prompt(session.id, { parts: [{ type: "text", text: "Take your time." }] });
    await readUntil(log, (e) => e.type === "session.next.step.started");
    const answer = await client.interrupt(session.id);
    assert.equal(answer.interrupted, true);
    const events = await readUntil(log, (e) => settled(e));
    assert.ok(settled(events.at(-1)!, "interrupted"), JSON.stringify(events.at(-1)));
    assert.ok(events.some((e) => e.type === "session.next.step.interrupted"));
  } finally {
    await server.stop();
  }
});

test("a permission request is answered and the call runs", async () => {
  const server = await Server.start(
    scripted(
      [
        { items: [{ type: "tool_call", name: "bash", input: { command: "echo allowed" } }] },
        { items: [{ type: "text", text: "Done." }] },
      ],
      `[agent.build.permissions]\nbash = "ask"\n`,
    ),
  );
  try {
    const client = new KeelClient(server.url);
    const session = await client.createSession();
    await client.prompt(session.id, { parts: [{ type: "text", text: "Run it." }] });
    let asked = 0;
    const events = await readUntil(
      client.sessionLog(session.id, { signal: closing.signal }),
      (e) => settled(e, "succeeded"),
      async (e) => {
        if (e.type !== "session.next.permission.requested") return;
        asked += 1;
        assert.equal(e.data.tool, "bash");
        const accepted = await client.replyPermission(session.id, e.data.request_id, { decision: "once" });
        assert.equal(accepted.accepted, true);
      },
    );
    assert.equal(asked, 1);
    assert.ok(events.some((e) => e.type === "session.next.permission.replied"));
    assert.ok(events.some((e) => settled(e, "awaiting")), "the first execution waited for the reply");
    const output = events.find((e) => e.type === "session.next.tool.success");
    assert.ok(output && JSON.stringify(output.data).includes("allowed"), JSON.stringify(output));
  } finally {
    await server.stop();
  }
});

test("errors are KeelErrors with the status and type, and nothing was changed", async () => {
  const client = new KeelClient(demo.url);
  await assert.rejects(client.getSession("ses_01KBFVGY400000000000000001"), (error) => {
    assert.ok(error instanceof KeelError);
    assert.equal(error.status, 404);
    assert.equal(error.type, "not_found");
    return true;
  });
  const session = await client.createSession();
  await assert.rejects(
    client.prompt(session.id, { parts: [] }),
    (error) => error instanceof KeelError && error.status === 422,
  );
  assert.equal((await client.getSession(session.id)).last_seq, 1, "the refused prompt wrote nothing");
  const guarded = await Server.start({}, ["--token", "secret"]);
  try {
    await assert.rejects(
      new KeelClient(guarded.url).listSessions(),
      (error) => error instanceof KeelError && error.status === 401,
    );
    const listed = await new KeelClient(guarded.url, { token: "secret" }).listSessions();
    assert.deepEqual(listed.items, []);
  } finally {
    await guarded.stop();
  }
});

test("the client has a method for every operation of the contract", () => {
  const contract = JSON.parse(
    readFileSync(fileURLToPath(new URL("../../../../contracts/openapi.json", import.meta.url)), "utf8"),
  ) as { paths: Record<string, Record<string, { operationId: string }>> };
  const camel = (name: string) => name.replace(/_(\w)/g, (_, c: string) => c.toUpperCase());
  const client = new KeelClient(demo.url) as unknown as Record<string, unknown>;
  for (const item of Object.values(contract.paths)) {
    for (const operation of Object.values(item)) {
      assert.equal(typeof client[camel(operation.operationId)], "function", operation.operationId);
    }
  }
});
