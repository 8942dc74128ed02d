// Keel's web console: the first user of the public API, through @keel/client only.
//
// With a token set on the server, the console asks for it once, checks it with
// `POST /api/login` (which also sets the read cookie) and keeps it in this tab's
// sessionStorage: writes send it as a bearer token, and the event streams, read with
// fetch, send it as a header, never in a URL.

import { KeelClient, KeelError } from "../../clients/typescript/src/index.js";
import { button, h } from "./dom.js";
import { Sessions } from "./sessions.js";
import { SessionView, message } from "./view.js";

const TOKEN_KEY = "keel.token";

const root = document.getElementById("app")!;

async function main(): Promise<void> {
  const token = sessionStorage.getItem(TOKEN_KEY) ?? undefined;
  const client = new KeelClient(location.origin, token ? { token } : {});
  try {
    await client.listSessions({ limit: 1 });
  } catch (error) {
    if (error instanceof KeelError && error.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      return login(token ? "The saved token is no longer accepted." : undefined);
    }
    return fail(error);
  }
  await app(client, token !== undefined);
}

/** Asks for the token, checks it with the login route, then starts the console. */
function login(notice?: string): void {
  const field = h("input", { type: "password", autocomplete: "current-password", "aria-label": "Token", required: true });
  const problem = h("div", { class: "error", hidden: !notice }, notice ?? "");
  const form = h(
    "form",
    { class: "login" },
    h("h1", {}, "Keel"),
    h("p", {}, "This server needs its token (", h("code", {}, "keel serve --token"), ")."),
    field,
    h("button", { type: "submit", class: "primary" }, "Sign in"),
    problem,
  );
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      await new KeelClient(location.origin).login(field.value);
      sessionStorage.setItem(TOKEN_KEY, field.value);
      await main();
    } catch (error) {
      problem.textContent = error instanceof KeelError && error.status === 401 ? "That token is not the server's." : message(error);
      problem.hidden = false;
    }
  });
  root.replaceChildren(form);
  field.focus();
}

function fail(error: unknown): void {
  root.replaceChildren(h("div", { class: "error page" }, `Keel cannot be reached: ${message(error)}`));
}

async function app(client: KeelClient, signedIn: boolean): Promise<void> {
  const stop = new AbortController();
  let view: SessionView | undefined;
  const main = h("main", { class: "content" }, h("div", { class: "empty" }, "Open a session, or start a new one."));
  const create = async () => {
    try {
      const session = await client.createSession();
      location.hash = `#/session/${session.id}`;
    } catch (error) {
      main.replaceChildren(h("div", { class: "error page" }, `No session created: ${message(error)}`));
    }
  };
  const sessions = new Sessions(client, () => void create());
  const version = h("span", { class: "version" });
  const header = h(
    "header",
    { class: "top" },
    h("a", { class: "brand", href: "#/" }, "Keel"),
    version,
    signedIn &&
      button("Sign out", async () => {
        await client.logout().catch(() => {});
        sessionStorage.removeItem(TOKEN_KEY);
        location.hash = "";
        location.reload();
      }),
  );
  root.replaceChildren(header, h("div", { class: "layout" }, sessions.element, main));
  client.health().then((health) => (version.textContent = `v${health.version}`), () => {});

  const route = () => {
    const id = /^#\/session\/(ses_\w+)$/.exec(location.hash)?.[1];
    view?.close();
    view = undefined;
    sessions.select(id);
    if (!id) {
      main.replaceChildren(h("div", { class: "empty" }, "Open a session, or start a new one."));
      return;
    }
    const opened = new SessionView(client, id, (changed) => sessions.refresh(changed));
    view = opened;
    main.replaceChildren(opened.element);
    opened.open().catch((error) => main.replaceChildren(h("div", { class: "error page" }, message(error))));
  };
  window.addEventListener("hashchange", route);
  try {
    await sessions.start(stop.signal);
  } catch (error) {
    return fail(error);
  }
  route();
}

void main();
