// Hash routing: #/signin, #/chat[/<conversation>[/<message>]], #/documents[/<collection>], #/search, #/training[/<job>], #/feedback, #/quality, #/evaluations[/<set>], #/mcp, #/people, #/tokens, #/audit.
// Every page but sign-in needs a key; a visit without one lands on sign-in.
// Navigation entries marked data-admin show for admins only, data-person for people (not keys).
import "./style.css";
import { forgetKey, getKey, loadSession, setUnauthorizedHandler, signedIn, signOut } from "./api";
import { caller, forgetCaller, isAdmin } from "./caller";
import { clear } from "./dom";
import { chatPage } from "./pages/chat";
import { documentsPage } from "./pages/documents";
import { evaluationsPage } from "./pages/evaluations";
import { feedbackPage } from "./pages/feedback";
import { auditPage } from "./pages/audit";
import { mcpPage } from "./pages/mcp";
import { peoplePage } from "./pages/people";
import { qualityPage } from "./pages/quality";
import { searchPage } from "./pages/search";
import { signinPage, whoami } from "./pages/signin";
import { tokensPage } from "./pages/tokens";
import { trainingPage } from "./pages/training";

export interface Page {
  /** Called when the page is left, to close sockets and streams. */
  dispose?: () => void;
  /** A change of sub-route (e.g. another conversation) the page handles in place; true if handled. */
  onRoute?: (args: string[]) => boolean;
}
type PageFn = (root: HTMLElement, args: string[]) => Page | void;

const pages: Record<string, PageFn> = {
  chat: chatPage,
  documents: documentsPage,
  search: searchPage,
  training: trainingPage,
  feedback: feedbackPage,
  quality: qualityPage,
  evaluations: evaluationsPage,
  mcp: mcpPage,
  people: peoplePage,
  tokens: tokensPage,
  audit: auditPage,
};

const titles: Record<string, string> = {
  signin: "Sign in",
  chat: "Chat",
  documents: "Documents",
  search: "Search",
  training: "Training",
  feedback: "Feedback",
  quality: "Quality",
  evaluations: "Evaluations",
  mcp: "MCP servers",
  people: "People",
  tokens: "Personal tokens",
  audit: "Audit log",
};

const main = document.getElementById("main") as HTMLElement;
const topbar = document.getElementById("topbar") as HTMLElement;
let current: Page | void;
let currentName = "";

function parseHash(): { name: string; args: string[] } {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  return { name: parts[0] ?? "chat", args: parts.slice(1) };
}

/** Shows the navigation entries the caller may use (an unknown caller sees none of the gated ones). */
async function gateNav(): Promise<void> {
  let admin = false;
  let person = false;
  try {
    const c = await caller();
    admin = isAdmin(c);
    person = Boolean(c.userId);
  } catch {
    /* not signed in, or the server is away: keep the gated entries hidden */
  }
  for (const li of document.querySelectorAll<HTMLElement>("#nav [data-admin]")) li.hidden = !admin;
  for (const li of document.querySelectorAll<HTMLElement>("#nav [data-person]")) li.hidden = !person;
}

function signedOut(): void {
  forgetKey();
  forgetCaller();
  if (!location.hash.startsWith("#/signin")) {
    const { name } = parseHash();
    location.hash = `#/signin${name && name !== "signin" ? `?next=${encodeURIComponent(name)}` : ""}`;
  }
}
setUnauthorizedHandler(signedOut);

async function route(): Promise<void> {
  const { name, args } = parseHash();
  // Sub-routes a page handles itself (e.g. picking a conversation) don't rebuild it.
  if (current && name === currentName && signedIn() && current.onRoute?.(args)) return;
  current?.dispose?.();
  current = undefined;
  clear(main);
  const key = signedIn();
  const base = name.split("?")[0];
  currentName = base;
  if (!key || base === "signin") {
    topbar.hidden = true;
    document.title = "Sign in · Tandem";
    if (key && base === "signin") {
      location.hash = "#/chat";
      return;
    }
    if (!key && base !== "signin") {
      signedOut();
      return;
    }
    current = signinPage(main);
    return;
  }
  topbar.hidden = false;
  void gateNav();
  const fn = pages[base] ?? pages.chat;
  const active = pages[base] ? base : "chat";
  for (const a of document.querySelectorAll<HTMLAnchorElement>("#nav a")) {
    if (a.dataset.route === active) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  document.title = `${titles[active]} · Tandem`;
  current = fn(main, args);
}

document.getElementById("signout")?.addEventListener("click", () => {
  forgetCaller();
  void signOut().then(() => {
    location.hash = "#/signin";
  });
});

window.addEventListener("hashchange", () => void route());

async function start(): Promise<void> {
  const key = getKey();
  if (key) {
    // A stored key may have been revoked since: check it once per load.
    try {
      const who = await whoami(key);
      const el = document.getElementById("who");
      if (el) el.textContent = who;
    } catch {
      forgetKey();
    }
  } else {
    // Back from the organisation's OpenID provider, or a reload: the session cookie, if live.
    const session = await loadSession();
    const el = document.getElementById("who");
    if (session && el) el.textContent = session.email ?? `tenant ${session.tenant}`;
  }
  await route();
}

void start();
