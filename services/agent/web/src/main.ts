// Hash routing: #/signin, #/chat[/<conversation>[/<message>]], #/documents[/<collection>], #/search, #/training[/<job>], #/feedback, #/quality, #/evaluations[/<set>], #/mcp.
// Every page but sign-in needs a key; a visit without one lands on sign-in.
import "./style.css";
import { forgetKey, getKey, setUnauthorizedHandler } from "./api";
import { clear } from "./dom";
import { chatPage } from "./pages/chat";
import { documentsPage } from "./pages/documents";
import { evaluationsPage } from "./pages/evaluations";
import { feedbackPage } from "./pages/feedback";
import { mcpPage } from "./pages/mcp";
import { qualityPage } from "./pages/quality";
import { searchPage } from "./pages/search";
import { signinPage, whoami } from "./pages/signin";
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
};

const main = document.getElementById("main") as HTMLElement;
const topbar = document.getElementById("topbar") as HTMLElement;
let current: Page | void;
let currentName = "";

function parseHash(): { name: string; args: string[] } {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  return { name: parts[0] ?? "chat", args: parts.slice(1) };
}

function signedOut(): void {
  forgetKey();
  if (!location.hash.startsWith("#/signin")) {
    const { name } = parseHash();
    location.hash = `#/signin${name && name !== "signin" ? `?next=${encodeURIComponent(name)}` : ""}`;
  }
}
setUnauthorizedHandler(signedOut);

async function route(): Promise<void> {
  const { name, args } = parseHash();
  // Sub-routes a page handles itself (e.g. picking a conversation) don't rebuild it.
  if (current && name === currentName && getKey() && current.onRoute?.(args)) return;
  current?.dispose?.();
  current = undefined;
  clear(main);
  const key = getKey();
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
  forgetKey();
  location.hash = "#/signin";
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
  }
  await route();
}

void start();
