// Server-sent events read from a fetch body (a ReadableStream, in Node and in browsers),
// as the HTML standard parses them: `field: value` lines, `data` lines joined with "\n",
// a blank line dispatching the message, comment lines (`:`) ignored but counted as
// signs of life.

/** One dispatched message. */
export interface Message {
  /** `event:`; "message" when the server set none. */
  event: string;
  data: string;
  /** `id:`, when the message set one. */
  id: string | undefined;
}

/**
 * The messages of `body`. Anything received (a heartbeat comment included) restarts a
 * `timeoutMs` watchdog; when it runs out, `connection` is aborted and the iterator
 * throws, so a dead connection is noticed even when no error reaches the socket.
 */
export async function* serverSentEvents(
  body: ReadableStream<Uint8Array>,
  connection: AbortController,
  timeoutMs: number,
): AsyncGenerator<Message, void, void> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let timer: ReturnType<typeof setTimeout> | undefined;
  // A connection aborted while this iterator waits at a `yield` (its reader stopped
  // reading) must not leave the watchdog armed: a pending timer keeps Node running.
  const disarm = () => clearTimeout(timer);
  connection.signal.addEventListener("abort", disarm, { once: true });
  const watch = () => {
    clearTimeout(timer);
    if (connection.signal.aborted) return;
    timer = setTimeout(
      () => connection.abort(new Error(`no event or heartbeat for ${timeoutMs} ms`)),
      timeoutMs,
    );
  };
  let buffer = "";
  let event = "";
  let data: string[] = [];
  let id: string | undefined;
  try {
    watch();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        // A "\r" held back below ends its line after all. Whatever else is left is an
        // incomplete message, which the standard says to drop.
        if (!buffer.endsWith("\r")) return;
        buffer = buffer.slice(0, -1) + "\n";
      } else {
        watch();
        buffer += decoder.decode(value, { stream: true });
      }
      let newline: number;
      while ((newline = buffer.search(/\r\n|\r|\n/)) >= 0) {
        const line = buffer.slice(0, newline);
        const width = buffer.startsWith("\r\n", newline) ? 2 : 1;
        // A lone "\r" at the end may be the first half of "\r\n": wait for more.
        if (!done && buffer[newline] === "\r" && newline + 1 === buffer.length) break;
        buffer = buffer.slice(newline + width);
        if (line === "") {
          if (data.length > 0) {
            yield { event: event || "message", data: data.join("\n"), id };
          }
          event = "";
          data = [];
          id = undefined;
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") data.push(value);
        else if (field === "event") event = value;
        else if (field === "id") id = value;
      }
      if (done) return;
    }
  } catch (error) {
    // An aborted read says only "aborted"; the reason says why.
    throw connection.signal.aborted && connection.signal.reason ? connection.signal.reason : error;
  } finally {
    clearTimeout(timer);
    connection.signal.removeEventListener("abort", disarm);
    reader.cancel().catch(() => {});
  }
}
