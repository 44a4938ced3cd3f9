// Who is signed in, as GET /v1/whoami says: the tenant, the role (operator, admin, member or
// viewer) and, for a person, the user's id and groups. The pages use it to show or hide what
// only admins or people may do; the services check every request themselves regardless.
import { api } from "./api";
import { h } from "./dom";

export interface Caller {
  tenant: string;
  role: string;
  /** Set for a person (a personal token or a browser session); null for a tenant key. */
  userId: string | null;
  groups: string[];
}

interface WhoAmI {
  tenant?: string;
  role?: string;
  user_id?: string | null;
  groups?: string[];
}

let known: Promise<Caller> | null = null;

/** The signed-in caller, asked once per sign-in (forgetCaller starts over). */
export function caller(): Promise<Caller> {
  known ??= api<WhoAmI>("/v1/whoami", { noAuthRedirect: true }).then(
    (who) => ({
      tenant: who?.tenant ?? "",
      // A server that does not say is treated as the least: admin pages stay hidden.
      role: who?.role ?? "",
      userId: who?.user_id ?? null,
      groups: Array.isArray(who?.groups) ? who.groups : [],
    }),
    (exc) => {
      known = null;
      throw exc;
    },
  );
  return known;
}

export function forgetCaller(): void {
  known = null;
}

export function isAdmin(c: Caller): boolean {
  return c.role === "admin" || c.role === "operator";
}

/**
 * A page for some callers only: its heading and intro at once, then, once the caller is known,
 * either what `refuse` says (a reason the caller cannot use it) or what `start` builds.
 */
export function callerPage(
  root: HTMLElement,
  page: { cls: string; title: string; intro: string },
  refuse: (c: Caller) => string | null,
  start: (c: Caller) => Node[] | Promise<Node[]>,
): void {
  const content = h("div", null, h("p", { class: "hint" }, "Loading…"));
  root.appendChild(h("div", { class: `page ${page.cls}` }, h("h1", null, page.title), h("p", { class: "hint" }, page.intro), content));
  caller()
    .then(async (c) => {
      const why = refuse(c);
      content.replaceChildren(...(why ? [h("p", { class: "card" }, why)] : await start(c)));
    })
    .catch((exc: Error) => content.replaceChildren(h("p", { class: "error", role: "alert" }, exc.message)));
}
