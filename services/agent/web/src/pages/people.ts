// People (admins only): the tenant's users (GET/POST /v1/users, PATCH/DELETE /v1/users/{id}):
// add one, change a role or groups, remove one, and see or make a person's tokens. A change that
// would leave the tenant without an admin is refused by the agent (409); the page says so next
// to the user and puts the field back as it was.
import { api, ApiError, enc, listOf } from "../api";
import { callerPage, isAdmin, type Caller } from "../caller";
import { clear, field, h, toast } from "../dom";
import { timeEl } from "../sources";
import { tokensPanel } from "./tokens";

export interface User {
  id: string;
  email: string;
  role: string;
  groups: string[];
  created_at: number;
  updated_at: number;
}

export const ROLES: [string, string][] = [
  ["admin", "admin: keys, users, models, promotions, MCP servers"],
  ["member", "member: chat, uploads where allowed, feedback"],
  ["viewer", "viewer: chat and search only"],
];

/** "ops, research ,,x" → ["ops", "research", "x"]: the groups typed into a field. */
export function parseGroups(text: string): string[] {
  return [...new Set(text.split(",").map((g) => g.trim()).filter(Boolean))];
}

/** The tenant's users (admins only); people.ts and the collection access editor share it. */
export async function tenantUsers(): Promise<User[]> {
  return listOf<User>(await api("/v1/users"));
}

/** A refusal as the page shows it: the last-admin 409 says what to do about it. */
function refusal(what: string, exc: unknown): string {
  const e = exc as ApiError;
  if (e.status === 409 && /admin/i.test(e.message)) return `${what}: the tenant must keep an admin. ${e.message}`;
  return `${what}: ${e.message}`;
}

function roleSelect(value: string, label: string): HTMLSelectElement {
  return h(
    "select",
    { "aria-label": label },
    ROLES.map(([role, title]) => h("option", { value: role, title, selected: role === value }, role)),
  );
}

export function peoplePage(root: HTMLElement) {
  const body = h("tbody");
  const table = h(
    "table",
    { class: "docs people", "aria-label": "People" },
    h(
      "thead",
      null,
      h(
        "tr",
        null,
        ...["Email", "Role", "Groups", "Added"].map((c) => h("th", { scope: "col" }, c)),
        h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions")),
      ),
    ),
    body,
  );
  const listErr = h("p", { class: "error", role: "alert", id: "people-error" });

  // --- add a person -----------------------------------------------------------------
  const email = h("input", { type: "email", required: true, maxlength: 254, autocomplete: "off", placeholder: "ada@example.org" });
  const role = roleSelect("member", "Role");
  role.removeAttribute("aria-label");
  const groups = h("input", { type: "text", autocomplete: "off", placeholder: "e.g. hr, research" });
  const addErr = h("p", { class: "error", role: "alert", id: "people-add-error" });
  const form = h(
    "form",
    { class: "card", "aria-labelledby": "people-add-title" },
    h("h2", { id: "people-add-title" }, "Add a person"),
    h(
      "div",
      { class: "row" },
      field("Email", email),
      field("Role", role),
      field("Groups", groups, "comma-separated; a collection's access list may name them"),
      h("button", { type: "submit", class: "primary" }, "Add"),
    ),
    addErr,
  );
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    addErr.textContent = "";
    try {
      const user = await api<User>("/v1/users", {
        json: { email: email.value.trim(), role: role.value, groups: parseGroups(groups.value) },
      });
      toast(`${user.email} added as ${user.role}.`);
      form.reset();
      await load();
    } catch (exc) {
      addErr.textContent = refusal("Not added", exc);
    }
  });

  // --- one person ---------------------------------------------------------------------
  function rows(u: User, me: Caller): HTMLElement[] {
    const roleEl = roleSelect(u.role, `Role of ${u.email}`);
    const groupsEl = h("input", { type: "text", value: u.groups.join(", "), "aria-label": `Groups of ${u.email}`, autocomplete: "off" });
    const save = h("button", { type: "button", "aria-label": `Save ${u.email}` }, "Save");
    const tokens = h("button", { type: "button", "aria-expanded": "false", "aria-label": `Tokens of ${u.email}` }, "Tokens");
    const remove = h("button", { type: "button", class: "danger", "aria-label": `Remove ${u.email}` }, "Remove");
    const err = h("p", { class: "error", role: "alert" });
    const tokensBox = h("div", { class: "user-tokens" });
    const extra = h("tr", { class: "user-extra" }, h("td", { colspan: "5" }, err, tokensBox));
    const isMe = me.userId === u.id;

    save.addEventListener("click", async () => {
      err.textContent = "";
      const patch: Record<string, unknown> = {};
      if (roleEl.value !== u.role) patch.role = roleEl.value;
      const g = parseGroups(groupsEl.value);
      if (g.join("\n") !== [...u.groups].sort().join("\n")) patch.groups = g;
      if (!Object.keys(patch).length) {
        toast(`${u.email}: nothing changed.`);
        return;
      }
      try {
        const after = await api<User>(`/v1/users/${enc(u.id)}`, { method: "PATCH", json: patch });
        toast(`${after.email} saved: ${after.role}${after.groups.length ? `, groups ${after.groups.join(", ")}` : ""}.`);
        await load();
      } catch (exc) {
        roleEl.value = u.role;
        err.textContent = refusal(`${u.email} not saved`, exc);
      }
    });
    remove.addEventListener("click", async () => {
      err.textContent = "";
      const note = isMe ? " This is you: you will be signed out." : "";
      if (!confirm(`Remove ${u.email}? Their tokens stop working at once.${note}`)) return;
      try {
        await api(`/v1/users/${enc(u.id)}`, { method: "DELETE" });
        toast(`${u.email} removed.`);
        await load();
      } catch (exc) {
        err.textContent = refusal(`${u.email} not removed`, exc);
      }
    });
    tokens.addEventListener("click", () => {
      const open = tokens.getAttribute("aria-expanded") !== "true";
      tokens.setAttribute("aria-expanded", String(open));
      clear(tokensBox);
      if (open) tokensBox.append(h("h3", null, `Tokens of ${u.email}`), tokensPanel(u.id, u.email));
    });
    return [
      h(
        "tr",
        { "data-user": u.id },
        h("td", null, u.email, isMe ? h("span", { class: "badge" }, " you") : null),
        h("td", null, roleEl),
        h("td", null, groupsEl),
        h("td", null, timeEl(u.created_at, "created")),
        h("td", null, h("div", { class: "row-buttons" }, save, tokens, remove)),
      ),
      extra,
    ];
  }

  let me: Caller = { tenant: "", role: "", userId: null, groups: [] };
  async function load(): Promise<void> {
    listErr.textContent = "";
    let users: User[];
    try {
      users = await tenantUsers();
    } catch (exc) {
      if (exc instanceof ApiError && exc.status === 401) return;
      listErr.textContent = `People: ${(exc as Error).message}`;
      return;
    }
    users.sort((a, b) => a.email.localeCompare(b.email));
    clear(body);
    if (!users.length) body.appendChild(h("tr", null, h("td", { colspan: "5", class: "muted" }, "No people yet: the tenant is used with API keys only.")));
    for (const u of users) body.append(...rows(u, me));
  }

  callerPage(
    root,
    {
      cls: "people-page",
      title: "People",
      intro:
        "Everyone who signs in to this tenant, with their role and groups. People who sign in with the organisation's identity provider appear here on their first sign-in.",
    },
    (c) => (isAdmin(c) ? null : "Only the tenant's admins manage people."),
    (c) => {
      me = c;
      void load();
      return [form, h("h2", null, "People of the tenant"), h("div", { class: "table-wrap" }, table), listErr];
    },
  );
}
