// The SSE parser on its own: line endings, multi-line data, comments, ids, events.

import assert from "node:assert/strict";
import { test } from "node:test";

import { serverSentEvents, type Message } from "../src/sse.js";

/** The messages `chunks` (sent one by one) make. */
async function parse(chunks: string[]): Promise<Message[]> {
  const encoder = new TextEncoder();
  const body = new ReadableStream<Uint8Array>({
    start(controller) {
      for (const chunk of chunks) controller.enqueue(encoder.encode(chunk));
      controller.close();
    },
  });
  const messages: Message[] = [];
  for await (const message of serverSentEvents(body, new AbortController(), 5_000)) {
    messages.push(message);
  }
  return messages;
}

test("fields, multi-line data, comments and every line ending", async () => {
  const messages = await parse([
    ": heartbeat\n\n",
    "id: 7\ndata: {\"a\":\n",
    "data: 1}\n\n",
    "event: synced\r\ndata: {}\r\n\r\n",
    "data:no space\r",
    "\r",
  ]);
  assert.deepEqual(messages, [
    { event: "message", data: '{"a":\n1}', id: "7" },
    { event: "synced", data: "{}", id: undefined },
    { event: "message", data: "no space", id: undefined },
  ]);
});

test("a message split anywhere, even inside a character, parses the same", async () => {
  const text = "id: 1\ndata: héllo\n\n";
  const bytes = new TextEncoder().encode(text);
  for (let cut = 1; cut < bytes.length; cut++) {
    const body = new ReadableStream<Uint8Array>({
      start(controller) {
        controller.enqueue(bytes.slice(0, cut));
        controller.enqueue(bytes.slice(cut));
        controller.close();
      },
    });
    const messages: Message[] = [];
    for await (const message of serverSentEvents(body, new AbortController(), 5_000)) {
      messages.push(message);
    }
    assert.deepEqual(messages, [{ event: "message", data: "héllo", id: "1" }], `cut at ${cut}`);
  }
});

test("a silent stream is aborted by the watchdog with the reason", async () => {
  const body = new ReadableStream<Uint8Array>({ pull: () => new Promise(() => {}) });
  const connection = new AbortController();
  // The body does not know the controller; the watchdog's abort reaches the reader
  // through the fetch in real use, so here the reason is checked on the controller.
  const reading = (async () => {
    for await (const _ of serverSentEvents(body, connection, 50)) {
      // Nothing arrives.
    }
  })();
  await new Promise((resolve) => setTimeout(resolve, 120));
  assert.ok(connection.signal.aborted);
  assert.match(String(connection.signal.reason), /no event or heartbeat for 50 ms/);
  void reading.catch(() => {});
});

test("a connection aborted while its reader waits at a message leaves no watchdog armed", async () => {
  const timers = () => process.getActiveResourcesInfo().filter((kind) => kind === "Timeout").length;
  const before = timers();
  const body = new ReadableStream<Uint8Array>({
    start(controller) {
      controller.enqueue(new TextEncoder().encode("data: 1\n\n"));
    },
  });
  const connection = new AbortController();
  const messages = serverSentEvents(body, connection, 60_000);
  assert.equal((await messages.next()).value?.data, "1");
  assert.equal(timers(), before + 1, "the watchdog is armed while the stream is read");
  // The reader stops at the message, as a log whose consumer went away does.
  connection.abort(new Error("stopped"));
  assert.equal(timers(), before, "aborting the connection disarmed it");
});
