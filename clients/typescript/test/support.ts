// A real `keel serve` for the tests: the binary cargo built (KEEL_BINARY, or the
// workspace's target/debug/keel), in a temporary directory, on a free loopback port.

import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, mkdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

import type { Envelope, KeelClient, LogItem } from "../src/index.js";

/** The workspace root: the nearest directory above this module holding Cargo.lock (the
 * module is compiled to different depths by the client's and the console's builds). */
function workspaceRoot(): string {
  let directory = dirname(fileURLToPath(import.meta.url));
  while (!existsSync(join(directory, "Cargo.lock"))) {
    const parent = dirname(directory);
    if (parent === directory) throw new Error("no Cargo.lock above the tests: set KEEL_BINARY");
    directory = parent;
  }
  return directory;
}


export const keelBinary = process.env.KEEL_BINARY ?? join(workspaceRoot(), "target/debug/keel");

export class Server {
  readonly url: string;
  readonly directory: string;
  private readonly child: ChildProcess;
  private readonly scratch: string;

  private constructor(url: string, directory: string, child: ChildProcess, scratch: string) {
    this.url = url;
    this.directory = directory;
    this.child = child;
    this.scratch = scratch;
  }

  /** Starts keel with `files` (name → content) written into its directory first. */
  static async start(files: Record<string, string> = {}, args: string[] = []): Promise<Server> {
    const scratch = mkdtempSync(join(tmpdir(), "keel-ts-"));
    const directory = join(scratch, "work");
    const data = join(scratch, "data");
    mkdirSync(directory);
    mkdirSync(data);
    for (const [name, content] of Object.entries(files)) {
      writeFileSync(join(directory, name), content);
    }
    const config = "keel.toml" in files ? ["--config", "keel.toml"] : [];
    const env: NodeJS.ProcessEnv = { ...process.env, RUST_LOG: "warn" };
    delete env.KEEL_TOKEN;
    delete env.KEEL_CONFIG;
    const child = spawn(
      keelBinary,
      ["serve", "--listen", "127.0.0.1:0", "--db", `sqlite://${join(data, "keel.db")}`, ...config, ...args],
      { cwd: directory, env, stdio: ["ignore", "pipe", "inherit"] },
    );
    const lines = createInterface({ input: child.stdout! });
    const first = await new Promise<string>((resolve, reject) => {
      lines.once("line", resolve);
      child.once("exit", (code) => reject(new Error(`keel exited with ${code} before listening`)));
    });
    const url = first.split(/\s+/).find((word) => /^https?:\/\//.test(word));
    if (!url) throw new Error(`no address in ${first}`);
    return new Server(url, directory, child, scratch);
  }

  async stop(): Promise<void> {
    const exited = new Promise((resolve) => this.child.once("exit", resolve));
    this.child.kill("SIGKILL");
    await exited;
    rmSync(this.scratch, { recursive: true, force: true });
  }
}

/**
 * Reads `log` until `until` matches a durable event; returns the durable events read.
 * The log stays open (no `for await`, which would close it), so reading can go on.
 */
export async function readUntil(
  log: AsyncGenerator<LogItem, void, void>,
  until: (event: Envelope) => boolean,
  onEvent: (event: Envelope) => Promise<void> = async () => {},
): Promise<Envelope[]> {
  const events: Envelope[] = [];
  for (;;) {
    const next = await log.next();
    if (next.done) throw new Error("the log ended before the awaited event");
    const item = next.value;
    if (item.kind !== "durable") continue;
    events.push(item.event);
    await onEvent(item.event);
    if (until(item.event)) return events;
  }
}

/** Whether `event` is an execution's settlement with `outcome`. */
export function settled(event: Envelope, outcome?: string): boolean {
  return (
    event.type === "session.next.execution.settled" &&
    (outcome === undefined || event.data.outcome === outcome)
  );
}

/** A scripted-model configuration whose model answers with `responses`, in order. */
export function scripted(responses: unknown[], extra = ""): Record<string, string> {
  return {
    "keel.toml": `default_model = "test/scripted"\n[provider.test]\nkind = "scripted"\nscript = "script.json"\n${extra}`,
    "script.json": JSON.stringify({ responses }),
  };
}

export type { KeelClient };
