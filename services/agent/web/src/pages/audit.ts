// Audit log (admins only): who did what in the tenant (GET /v1/audit), newest first a page at a
// time, filtered by who (a person's email or a key's id), action and time; "Export" downloads
// every matching entry as JSON lines (format=jsonl), oldest first, as the agent streams them.
import { ApiError, api, authHeaders, errorFromBody } from "../api";
import { callerPage, isAdmin } from "../caller";
import { clear, field, h, toast } from "../dom";
import { timeEl } from "../sources";
import { tenantUsers, type User } from "./people";

interface Entry {
  id: string;
  at: number;
  tenant: string;
  actor: { kind: string; id: string };
  action: string;
  target: string;
  detail: Record<string, unknown>;
}

interface AuditPage {
  data: Entry[];
  has_more: boolean;
  next_before: string | null;
}

const PAGE = 50;
// The actions the services record (services/common/audit.py), offered as suggestions.
const ACTIONS = [
  "user.sign_in",
  "user.sign_out",
  "user.create",
  "user.update",
  "user.delete",
  "token.create",
  "token.revoke",
  "key.create",
  "key.revoke",
  "collection.access",
  "document.upload",
  "document.delete",
  "source.add",
  "source.delete",
  "source.sync",
  "training.start",
  "training.job",
  "model.promote",
  "model.rollback",
  "mcp_server.register",
  "mcp_server.update",
  "mcp_server.remove",
];

/** A datetime-local value ("2025-05-01T09:30") as unix seconds in the browser's time zone. */
export function localToUnix(value: string): number | null {
  if (!value) return null;
  const t = new Date(value).getTime();
  return Number.isNaN(t) ? null : t / 1000;
}

export function auditPage(root: HTMLElement) {
  let byId = new Map<string, User>();
  let byEmail = new Map<string, User>();

  const who = h("input", { type: "text", list: "audit-people", autocomplete: "off", placeholder: "anyone", maxlength: 254 });
  const people = h("datalist", { id: "audit-people" });
  const action = h("input", { type: "text", list: "audit-actions", autocomplete: "off", placeholder: "any", maxlength: 64 });
  const actions = h("datalist", { id: "audit-actions" }, ACTIONS.map((a) => h("option", { value: a })));
  const since = h("input", { type: "datetime-local", step: 1 });
  const until = h("input", { type: "datetime-local", step: 1 });
  const filterErr = h("p", { class: "error", role: "alert", id: "audit-error" });
  const exportBtn = h("button", { type: "button", id: "audit-export" }, "Export JSON lines");
  const filters = h(
    "form",
    { class: "card", "aria-label": "Audit filters" },
    h(
      "div",
      { class: "row" },
      field("User", who, "an email, or a key's id"),
      field("Action", action),
      field("From", since),
      field("To", until),
      h("div", { class: "row-buttons" }, h("button", { type: "submit", class: "primary" }, "Filter"), exportBtn),
    ),
    people,
    actions,
    filterErr,
  );

  const body = h("tbody");
  const table = h(
    "table",
    { class: "docs audit", "aria-label": "Audit entries" },
    h("thead", null, h("tr", null, ...["When", "Who", "Action", "Target", "Detail"].map((c) => h("th", { scope: "col" }, c)))),
    body,
  );
  const more = h("button", { type: "button", hidden: true }, "Older entries");
  let next: string | null = null;
  let generation = 0;

  /** The filter as query parameters; an error names the field it is about. */
  function query(): URLSearchParams {
    const q = new URLSearchParams();
    const text = who.value.trim();
    if (text) q.set("actor", byEmail.get(text.toLowerCase())?.id ?? text);
    if (action.value.trim()) q.set("action", action.value.trim());
    const from = localToUnix(since.value);
    const to = localToUnix(until.value);
    if (from !== null) q.set("since", String(from));
    if (to !== null) q.set("until", String(to));
    if (from !== null && to !== null && from > to) throw new ApiError("“From” is after “To”.", 400);
    return q;
  }

  function whoText(actor: Entry["actor"]): HTMLElement {
    const user = actor.kind === "user" ? byId.get(actor.id) : undefined;
    if (user) return h("span", { title: actor.id }, user.email);
    return h("span", null, `${actor.kind} `, h("code", null, actor.id));
  }

  function row(e: Entry): HTMLElement {
    const target = byId.get(e.target);
    const detail = Object.keys(e.detail ?? {}).length ? JSON.stringify(e.detail) : "";
    return h(
      "tr",
      { "data-entry": e.id, "data-action": e.action },
      h("td", null, timeEl(e.at, "at")),
      h("td", null, whoText(e.actor)),
      h("td", null, h("code", null, e.action)),
      h("td", null, target ? h("span", { title: e.target }, target.email) : e.target ? h("code", null, e.target) : ""),
      h("td", { class: "audit-detail" }, detail ? h("code", null, detail) : ""),
    );
  }

  async function load(reset: boolean): Promise<void> {
    filterErr.textContent = "";
    let q: URLSearchParams;
    try {
      q = query();
    } catch (exc) {
      filterErr.textContent = (exc as Error).message;
      return;
    }
    q.set("limit", String(PAGE));
    if (!reset && next) q.set("before", next);
    const mine = ++generation;
    let page: AuditPage;
    try {
      page = await api<AuditPage>(`/v1/audit?${q}`);
    } catch (exc) {
      if (exc instanceof ApiError && exc.status === 401) return;
      if (mine === generation) filterErr.textContent = `Audit log: ${(exc as Error).message}`;
      return;
    }
    if (mine !== generation) return;
    if (reset) clear(body);
    for (const e of page.data ?? []) body.appendChild(row(e));
    if (!body.children.length) body.appendChild(h("tr", null, h("td", { colspan: "5", class: "muted" }, "No entries match.")));
    next = page.has_more ? page.next_before : null;
    more.hidden = !next;
  }

  filters.addEventListener("submit", (ev) => {
    ev.preventDefault();
    void load(true);
  });
  more.addEventListener("click", () => void load(false));

  exportBtn.addEventListener("click", async () => {
    filterErr.textContent = "";
    try {
      const q = query();
      q.set("format", "jsonl");
      const resp = await fetch(`/v1/audit?${q}`, { headers: { Accept: "application/jsonl", ...authHeaders() } });
      if (!resp.ok) {
        let data: unknown = null;
        try {
          data = await resp.json();
        } catch {
          /* not JSON */
        }
        throw errorFromBody(resp.status, data, `export failed: HTTP ${resp.status}`);
      }
      const text = await resp.text();
      const lines = text.split("\n").filter(Boolean).length;
      const link = h("a", {
        href: URL.createObjectURL(new Blob([text], { type: "application/jsonl" })),
        download: `audit-${new Date().toISOString().slice(0, 19).replace(/[:T]/g, "-")}.jsonl`,
        hidden: true,
      });
      document.body.appendChild(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
      toast(`Exported ${lines} ${lines === 1 ? "entry" : "entries"}.`);
    } catch (exc) {
      filterErr.textContent = `Export: ${(exc as Error).message}`;
    }
  });

  callerPage(
    root,
    {
      cls: "audit-page",
      title: "Audit log",
      intro:
        "Who did what in this tenant: sign-ins, keys and tokens, people and roles, collection access, uploads and deletions, training, promotions and MCP servers. Entries are never changed or removed, only aged out.",
    },
    (c) => (isAdmin(c) ? null : "Only the tenant's admins read the audit log."),
    async () => {
      try {
        const users = await tenantUsers();
        byId = new Map(users.map((u) => [u.id, u]));
        byEmail = new Map(users.map((u) => [u.email.toLowerCase(), u]));
        people.replaceChildren(...users.map((u) => h("option", { value: u.email })));
      } catch (exc) {
        toast(`People: ${(exc as Error).message}`, "error");
      }
      void load(true);
      return [filters, h("div", { class: "table-wrap" }, table), more];
    },
  );
}
