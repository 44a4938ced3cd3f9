// A collection's access list on the documents page (admins only): who may read it and who may
// also write it (GET/PUT/DELETE /api/retrieval/v1/collections/{name}/access), chosen from the
// tenant's people and groups. Without a list the collection is open to the whole tenant.
import { api, ApiError, enc, retrieval } from "./api";
import { append, clear, h, toast } from "./dom";
import { tenantUsers, type User } from "./pages/people";

interface CollectionAccess {
  collection: string;
  open: boolean;
  readers: string[];
  writers: string[];
  updated_at?: number | null;
}

type Side = "readers" | "writers";

/** How an entry reads: a person's email, "group hr", "key 1a2b". */
export function entryLabel(entry: string, users: Map<string, User>): string {
  const [kind, ...rest] = entry.split(":");
  const ident = rest.join(":");
  if (kind === "user") return users.get(ident)?.email ?? `user ${ident}`;
  return `${kind} ${ident}`;
}

export interface AccessPanel {
  el: HTMLElement;
  toggle: HTMLButtonElement;
  show: (coll: string | null) => void;
}

export function accessPanel(): AccessPanel {
  let coll: string | null = null;
  let users = new Map<string, User>();
  let groups: string[] = [];
  const lists: Record<Side, string[]> = { readers: [], writers: [] };
  let generation = 0;

  const toggle = h("button", { type: "button", id: "access-toggle", "aria-expanded": "false", "aria-controls": "access-panel", hidden: true }, "Access");
  const state = h("p", { id: "access-state", "aria-live": "polite" });
  const err = h("p", { class: "error", role: "alert", id: "access-error" });
  const sides: Record<Side, { list: HTMLUListElement; pick: HTMLSelectElement }> = {
    readers: {
      list: h("ul", { class: "chips access-list", "aria-label": "Readers" }),
      pick: h("select", { "aria-label": "Add a reader" }),
    },
    writers: {
      list: h("ul", { class: "chips access-list", "aria-label": "Writers" }),
      pick: h("select", { "aria-label": "Add a writer" }),
    },
  };
  const save = h("button", { type: "submit", class: "primary", id: "access-save" }, "Save access list");
  const open = h("button", { type: "button", id: "access-open" }, "Open to the whole tenant");

  function sideBox(side: Side, legend: string, hint: string): HTMLElement {
    const add = h("button", { type: "button" }, legend === "Readers" ? "Add reader" : "Add writer");
    add.addEventListener("click", () => {
      const entry = sides[side].pick.value;
      if (!entry || lists[side].includes(entry)) return;
      lists[side].push(entry);
      render();
    });
    return h(
      "fieldset",
      { class: "access-side" },
      h("legend", null, legend),
      h("p", { class: "hint" }, hint),
      sides[side].list,
      h("div", { class: "row-buttons" }, sides[side].pick, add),
    );
  }

  const form = h(
    "form",
    { class: "card access-panel", id: "access-panel", "aria-labelledby": "access-title", hidden: true },
    h("h2", { id: "access-title" }, "Who may use this collection"),
    state,
    h(
      "div",
      { class: "access-sides" },
      sideBox("readers", "Readers", "search it, chat over it, read its documents"),
      sideBox("writers", "Writers", "also upload, delete and manage its sources (writers read too)"),
    ),
    h("p", { class: "hint" }, "The tenant's admins read and write every collection; viewers never write."),
    err,
    h("div", { class: "row-buttons" }, save, open),
  );

  function options(side: Side): void {
    const taken = new Set(lists[side]);
    const people = [...users.values()].filter((u) => !taken.has(`user:${u.id}`));
    const named = groups.filter((g) => !taken.has(`group:${g}`));
    const pick = sides[side].pick;
    clear(pick);
    append(pick, [
      h("option", { value: "" }, people.length || named.length ? "Choose…" : "No one left to add"),
      people.length ? h("optgroup", { label: "People" }, people.map((u) => h("option", { value: `user:${u.id}` }, `${u.email} (${u.role})`))) : null,
      named.length ? h("optgroup", { label: "Groups" }, named.map((g) => h("option", { value: `group:${g}` }, `group ${g}`))) : null,
    ]);
  }

  function render(): void {
    for (const side of ["readers", "writers"] as Side[]) {
      const { list } = sides[side];
      clear(list);
      if (!lists[side].length) list.appendChild(h("li", { class: "muted" }, "nobody"));
      for (const entry of lists[side]) {
        const label = entryLabel(entry, users);
        const remove = h("button", { type: "button", class: "icon", "aria-label": `Remove ${label} from ${side}`, title: "Remove" }, "✕");
        remove.addEventListener("click", () => {
          lists[side] = lists[side].filter((e) => e !== entry);
          render();
        });
        list.appendChild(h("li", { class: "chip", "data-entry": entry }, label, " ", remove));
      }
      options(side);
    }
  }

  function showState(acl: CollectionAccess): void {
    state.dataset.open = String(acl.open);
    state.textContent = acl.open
      ? "Open: everyone in the tenant reads this collection, and everyone but viewers writes it. Save a list to restrict it."
      : "Restricted: only the readers and writers below, and the tenant's admins, see this collection.";
    lists.readers = [...acl.readers];
    lists.writers = [...acl.writers];
    open.hidden = acl.open;
    render();
  }

  async function load(): Promise<void> {
    const name = coll;
    if (!name) return;
    const mine = ++generation;
    err.textContent = "";
    state.textContent = "Loading…";
    try {
      const [acl, people] = await Promise.all([api<CollectionAccess>(retrieval(`/collections/${enc(name)}/access`)), tenantUsers()]);
      if (mine !== generation) return;
      users = new Map(people.map((u) => [u.id, u]));
      groups = [...new Set(people.flatMap((u) => u.groups))].sort();
      showState(acl);
    } catch (exc) {
      if (mine !== generation || (exc instanceof ApiError && exc.status === 401)) return;
      state.textContent = "";
      err.textContent = `Access: ${(exc as Error).message}`;
    }
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const name = coll;
    if (!name) return;
    err.textContent = "";
    if (!lists.readers.length && !lists.writers.length && !confirm(`Save an empty list? Only the tenant's admins will see “${name}”.`)) return;
    try {
      const acl = await api<CollectionAccess>(retrieval(`/collections/${enc(name)}/access`), {
        method: "PUT",
        json: { readers: lists.readers, writers: lists.writers },
      });
      if (name !== coll) return;
      showState(acl);
      toast(`Access to “${name}” saved.`);
    } catch (exc) {
      if (name === coll) err.textContent = `Not saved: ${(exc as Error).message}`;
    }
  });

  open.addEventListener("click", async () => {
    const name = coll;
    if (!name || !confirm(`Open “${name}” to everyone in the tenant?`)) return;
    err.textContent = "";
    try {
      await api(retrieval(`/collections/${enc(name)}/access`), { method: "DELETE" });
      if (name !== coll) return;
      showState({ collection: name, open: true, readers: [], writers: [] });
      toast(`“${name}” is open to the whole tenant.`);
    } catch (exc) {
      if (name === coll) err.textContent = `Not opened: ${(exc as Error).message}`;
    }
  });

  function setOpen(expanded: boolean): void {
    form.hidden = !expanded;
    toggle.setAttribute("aria-expanded", String(expanded));
    if (expanded) void load();
  }
  toggle.addEventListener("click", () => setOpen(toggle.getAttribute("aria-expanded") !== "true"));

  return {
    el: form,
    toggle,
    show(name: string | null) {
      if (name === coll) return;
      coll = name;
      generation++;
      setOpen(false);
    },
  };
}
