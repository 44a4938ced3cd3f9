// Personal tokens: a person's API tokens (GET/POST /v1/users/{id}/tokens, DELETE .../{token_id}).
// A new token is shown once, right after it is made; the list shows names and times, never
// tokens. The page is the signed-in person's own; people.ts shows the same panel for any user.
import { api, ApiError, enc, listOf } from "../api";
import { callerPage } from "../caller";
import { clear, field, h, toast } from "../dom";
import { timeEl } from "../sources";

interface Token {
  id: string;
  user_id: string;
  name: string;
  created_at: number;
  last_used_at: number | null;
  expires_at: number | null;
  revoked: boolean;
}

interface TokenCreated extends Token {
  token: string;
}

const DAY_S = 86_400;
const LIFETIMES: [string, number | null][] = [
  ["Never", null],
  ["30 days", 30],
  ["90 days", 90],
  ["1 year", 365],
];

export function tokenState(t: Token, nowS: number = Date.now() / 1000): "active" | "revoked" | "expired" {
  if (t.revoked) return "revoked";
  if (t.expires_at !== null && t.expires_at <= nowS) return "expired";
  return "active";
}

/** The token list and "Create a token" form of one user; `whose` names them in labels. */
export function tokensPanel(userId: string, whose: string): HTMLElement {
  const base = `/v1/users/${enc(userId)}/tokens`;
  const body = h("tbody");
  const table = h(
    "table",
    { class: "docs tokens", "aria-label": `Tokens of ${whose}` },
    h(
      "thead",
      null,
      h(
        "tr",
        null,
        ...["Name", "Created", "Last used", "Expires", "State"].map((c) => h("th", { scope: "col" }, c)),
        h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions")),
      ),
    ),
    body,
  );
  const listErr = h("p", { class: "error", role: "alert" });

  const name = h("input", { type: "text", maxlength: 128, autocomplete: "off", placeholder: "e.g. laptop" });
  const lifetime = h("select", null, LIFETIMES.map(([label, days]) => h("option", { value: days === null ? "" : String(days) }, label)));
  const createErr = h("p", { class: "error", role: "alert" });
  const shown = h("div", { class: "token-once", hidden: true, "aria-live": "polite" });
  const form = h(
    "form",
    { class: "row token-form", "aria-label": `Create a token for ${whose}` },
    field("Token name", name, "a label to recognise it by"),
    field("Expires", lifetime),
    h("button", { type: "submit", class: "primary" }, "Create token"),
  );

  function showOnce(created: TokenCreated): void {
    const code = h("code", { class: "token-value" }, created.token);
    const copy = h("button", { type: "button" }, "Copy");
    copy.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(created.token);
        toast("Token copied.");
      } catch {
        toast("Copy failed: select the token and copy it yourself.", "error");
      }
    });
    const done = h("button", { type: "button" }, "Done");
    done.addEventListener("click", () => {
      shown.hidden = true;
      clear(shown);
    });
    shown.replaceChildren(
      h("p", { class: "success" }, `Token “${created.name || created.id}” created. Copy it now: it is not shown again.`),
      h("p", { class: "token-line" }, code, " ", copy, " ", done),
      h("p", { class: "hint" }, "Send it as 'Authorization: Bearer <token>'. It acts with the user's role, as that role is at each request."),
    );
    shown.hidden = false;
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    createErr.textContent = "";
    const json: Record<string, unknown> = { name: name.value.trim() };
    if (lifetime.value) json.expires_at = Math.floor(Date.now() / 1000) + Number(lifetime.value) * DAY_S;
    try {
      const created = await api<TokenCreated>(base, { json });
      form.reset();
      showOnce(created);
      await load();
    } catch (exc) {
      createErr.textContent = `Could not create the token: ${(exc as Error).message}`;
    }
  });

  function row(t: Token): HTMLElement {
    const state = tokenState(t);
    const revoke = h("button", { type: "button", class: "danger", "aria-label": `Revoke ${t.name || t.id}` }, "Revoke");
    revoke.addEventListener("click", async () => {
      if (!confirm(`Revoke the token “${t.name || t.id}”? Whatever uses it stops working at once.`)) return;
      try {
        await api(`${base}/${enc(t.id)}`, { method: "DELETE" });
        toast(`Token “${t.name || t.id}” revoked.`);
        await load();
      } catch (exc) {
        toast(`Revoke failed: ${(exc as Error).message}`, "error");
      }
    });
    return h(
      "tr",
      { "data-token": t.id, "data-state": state },
      h("td", null, t.name || h("span", { class: "muted" }, "(no name)")),
      h("td", null, timeEl(t.created_at, "created")),
      h("td", null, timeEl(t.last_used_at, "last-used")),
      h("td", null, t.expires_at === null ? h("span", { class: "muted" }, "never") : timeEl(t.expires_at, "expires")),
      h("td", null, h("span", { class: `badge ${state === "active" ? "succeeded" : "failed"}` }, state)),
      h("td", null, state === "active" ? revoke : null),
    );
  }

  async function load(): Promise<void> {
    listErr.textContent = "";
    let tokens: Token[];
    try {
      tokens = listOf<Token>(await api(base));
    } catch (exc) {
      if (exc instanceof ApiError && exc.status === 401) return;
      listErr.textContent = `Tokens: ${(exc as Error).message}`;
      return;
    }
    tokens.sort((a, b) => b.created_at - a.created_at);
    clear(body);
    if (!tokens.length) body.appendChild(h("tr", null, h("td", { colspan: "6", class: "muted" }, "No tokens yet.")));
    for (const t of tokens) body.appendChild(row(t));
  }

  void load();
  return h("div", { class: "tokens-panel" }, form, createErr, shown, h("div", { class: "table-wrap" }, table), listErr);
}

export function tokensPage(root: HTMLElement) {
  callerPage(
    root,
    {
      cls: "tokens-page",
      title: "Personal tokens",
      intro:
        "Tokens let scripts and tools call Tandem's API as you, with your role and your access to collections. Revoke one and it stops working everywhere at once.",
    },
    (c) =>
      c.userId
        ? null
        : "You are signed in with a tenant API key, not as a person: a key has no personal tokens. " +
          "Admins make tokens for people on the People page, or with `tandem users token create`.",
    (c) => [tokensPanel(c.userId ?? "", "you")],
  );
}
