// Chat: conversations on the left, the exchange on the right. Answers stream over the
// agent's websocket (/v1/ws/chat, key as the "tandem.bearer" subprotocol); citations
// come as chips that open the cited passage with the cited span highlighted.
import { api, ApiError, enc, getKey, inference, listOf, retrieval, signedIn, sse, wsUrl } from "../api";
import { clear, field, h, highlightSpan, toast } from "../dom";
import { addToEvaluation } from "../evalpick";
import { thumbIcon } from "../icons";
import { linkCitations, renderMarkdown } from "../markdown";
import { highlightOf, pageOfSpan, type LineBox, type PageSize } from "../boxes";
import { documentNodes, fetchOriginal, showImagePage, showPdfPage } from "../source";

export interface Citation {
  index: number;
  chunk_id?: string;
  document_id?: string;
  title?: string;
  text?: string;
  start?: number;
  end?: number;
  kind?: string;
  page?: number | null;
  section?: string | null;
  anchor?: string | null;
  span?: { start: number; end: number; text?: string } | null;
  /** Line boxes of the cited chunk (PDF and image sources): offsets into ``text``. */
  boxes?: LineBox[] | null;
  page_sizes?: PageSize[] | null;
}

interface Step {
  kind: string;
  [k: string]: unknown;
}

/** An agent run stopped before a tool call with side effects (the agent's side_effects: approve). */
interface ApprovalRequired {
  approval_id: string;
  tool: string;
  arguments?: unknown;
  expires_at?: number;
}

interface Conversation {
  id?: string;
  conversation_id?: string;
  title?: string;
  updated_at?: number | string;
}

interface StoredMessage {
  role: string;
  content: string;
  citations?: Citation[];
  steps?: Step[];
  /** The assistant turn's id (feedback, regenerate and choose name it). */
  message_id?: string;
  /** The caller's feedback on it, when the agent includes it. */
  feedback?: { rating?: number; correction?: string | null } | null;
}

export interface ModelCard {
  id: string;
  kind?: string;
  owned_by?: string;
  root?: string;
  parent?: string | null;
}

/** An adapter or registered model (the tenant's fine-tunes, or ones the operator registered) rather than a base model. */
export function isFineTune(m: ModelCard): boolean {
  return m.kind === "adapter" || m.kind === "registered" || Boolean(m.parent);
}

/** What GET /api/inference/v1/models lists for the caller's tenant: base models and its fine-tunes. */
export async function loadModels(): Promise<ModelCard[]> {
  // Embedding and rerank models are listed too, but cannot write answers.
  return listOf<ModelCard>(await api(inference("/models")), "models").filter(
    (m) => m && typeof m.id === "string" && m.kind !== "embedding" && m.kind !== "rerank",
  );
}

type Target = { kind: "pipeline" | "agent"; name: string; collection: string };

const PREFS = "tandem.chat.target";

function loadTarget(): Target {
  try {
    const t = JSON.parse(localStorage.getItem(PREFS) ?? "");
    if (t && (t.kind === "pipeline" || t.kind === "agent")) return t as Target;
  } catch {
    /* no saved choice */
  }
  return { kind: "pipeline", name: "chat-documents", collection: "docs" };
}

const convId = (c: Conversation) => c.id ?? c.conversation_id ?? "";

/**
 * Chat pipelines and agents from the agent's catalog (GET /v1/pipelines: {data: [{id, kind}]},
 * kind "pipeline:chat", "pipeline:search" or "agent"). Search pipelines return passages, not
 * answers: they live on the Search page.
 */
async function loadChoices(): Promise<{ pipelines: string[]; agents: string[] }> {
  const pipelines: string[] = [];
  const agents: string[] = [];
  try {
    for (const item of listOf<Record<string, string>>(await api("/v1/pipelines"), "pipelines")) {
      const id = item.id ?? item.name;
      const kind = item.kind ?? "";
      if (!id) continue;
      if (kind === "agent") agents.push(id);
      else if (!kind.endsWith("search")) pipelines.push(id);
    }
  } catch (exc) {
    toast(`Pipelines: ${(exc as Error).message}`, "error");
  }
  if (!pipelines.length && !agents.length) pipelines.push("chat-documents");
  return { pipelines, agents };
}

export async function loadCollections(): Promise<string[]> {
  const data = await api(retrieval("/collections"));
  return listOf<Record<string, string> | string>(data, "collections").map((c) =>
    typeof c === "string" ? c : c.name,
  );
}

/** The dialog that shows a cited passage inside its document: the cited sentence marked in the
 * document's text with its headings, and for a PDF or an image the cited page itself (pdf.js, or
 * the image) with the sentence highlighted on it (from the chunk's line boxes where it has some). */
export function citationDialog(): { open: (c: Citation, collection: string) => void; el: HTMLDialogElement } {
  const title = h("h2", { id: "cite-title" });
  const meta = h("p", { class: "muted cite-meta" });
  const pdfBox = h("div", { class: "pdf-view", hidden: true });
  const body = h("div", { class: "passage", tabindex: "0", "aria-label": "Cited passage" });
  const close = h("button", { type: "button", class: "close" }, "Close");
  const el = h(
    "dialog",
    { class: "citation-dialog", "aria-labelledby": "cite-title" },
    h("div", { class: "dialog-head" }, title, close),
    meta,
    pdfBox,
    body,
  );
  close.addEventListener("click", () => el.close());
  el.addEventListener("click", (ev) => {
    if (ev.target === el) el.close();
  });
  let opened = 0;
  async function open(c: Citation, collection: string): Promise<void> {
    const mine = ++opened;
    title.textContent = `[${c.index}] ${c.title || c.document_id || "Cited passage"}`;
    // The cited sentence where the agent located one, else the whole cited chunk.
    const span = c.span && c.span.end > c.span.start ? c.span : null;
    const from = span ? span.start : c.start;
    const to = span ? span.end : c.end;
    meta.textContent = [
      c.document_id ? `document ${c.document_id}` : "",
      c.section ? `section ${c.section}` : "",
      c.page ? `page ${c.page}` : "",
      c.anchor ? `#${c.anchor}` : "",
      from !== undefined && to !== undefined ? `characters ${from}–${to}` : "",
    ]
      .filter(Boolean)
      .join(" · ");
    clear(body);
    clear(pdfBox);
    pdfBox.hidden = true;
    const chunkText = c.text ?? "";
    if (span && c.start !== undefined && span.start >= c.start && span.end <= c.start + chunkText.length) {
      body.append(...highlightSpan(chunkText, span.start - c.start, span.end - c.start));
    } else {
      body.append(...highlightSpan(chunkText, 0, chunkText.length));
    }
    if (!el.open) el.showModal();
    close.focus();
    const sentence = span?.text ?? chunkText;
    if (c.page && c.document_id && collection) {
      pdfBox.hidden = false;
      // The cited sentence within the chunk's text (the boxes' offsets), else the whole chunk.
      const inChunk = span && c.start !== undefined ? [span.start - c.start, span.end - c.start] : [0, chunkText.length];
      const page = pageOfSpan(c.boxes, inChunk[0], inChunk[1], c.page);
      const boxes = highlightOf(c.boxes, c.page_sizes, inChunk[0], inChunk[1], page);
      const note = h("p", { class: "muted" }, "Loading the original…");
      pdfBox.append(note);
      void (async () => {
        try {
          const url = retrieval(`/collections/${enc(collection)}/originals/${enc(c.document_id ?? "")}?page=${page}`);
          const original = await fetchOriginal(url);
          if (mine !== opened) return;
          note.remove();
          if (original.type.startsWith("image/")) await showImagePage(pdfBox, original, page, boxes);
          else await showPdfPage(pdfBox, original.data, page, sentence, boxes);
        } catch (exc) {
          if (mine !== opened) return;
          // A paged document kept without its file (a deck's slides): the text below is the source.
          if (exc instanceof ApiError && exc.status === 404) pdfBox.hidden = true;
          else note.textContent = `The original cannot be shown: ${(exc as Error).message}`;
        }
      })();
    }
    // Show the passage in its document when the document's text can be had.
    if (c.document_id && collection && from !== undefined && to !== undefined) {
      try {
        const doc = await api<Record<string, unknown>>(
          retrieval(`/collections/${enc(collection)}/documents/${enc(c.document_id)}`),
        );
        const text = typeof doc.text === "string" ? doc.text : null;
        if (mine === opened && text && to <= text.length) {
          clear(body);
          body.append(...documentNodes(text, from, to));
        }
      } catch {
        /* the chunk text alone is still the cited passage */
      }
    }
    body.querySelector("mark")?.scrollIntoView({ block: "center" });
  }
  return { open: (c, col) => void open(c, col), el };
}

function stepView(step: Step): HTMLElement {
  const { kind = "step", ...rest } = step;
  delete (rest as Record<string, unknown>).type;
  let text: string;
  if (kind === "tool_call") {
    const tool = rest.tool ?? rest.name ?? "tool";
    const args = rest.input ?? rest.arguments ?? rest.args;
    text = `${tool}(${typeof args === "string" ? args : JSON.stringify(args ?? {})})`;
  } else {
    const t = rest.text ?? rest.content ?? rest.output ?? rest.observation ?? rest.answer;
    text = typeof t === "string" ? t : JSON.stringify(rest);
  }
  return h("li", { class: `step step-${kind}` }, h("span", { class: "step-kind" }, kind.replace("_", " ")), " ", text);
}

export function chatPage(root: HTMLElement, args: string[]) {
  let target = loadTarget();
  let conversationId: string | null = args[0] ?? null;
  let socket: WebSocket | null = null;
  let streaming = false;
  let disposed = false;

  const dialog = citationDialog();

  // --- sidebar: conversations -------------------------------------------------
  const convList = h("ul", { class: "conv-list", "aria-label": "Conversations" });
  const newButton = h("button", { type: "button", class: "primary", id: "new-conversation" }, "New conversation");
  const sidebar = h(
    "aside",
    { class: "sidebar", "aria-label": "Conversations" },
    h("div", { class: "sidebar-head" }, h("h2", null, "Conversations"), newButton),
    convList,
  );

  // --- target selection ---------------------------------------------------------
  const kindSel = h(
    "select",
    { id: "chat-kind" },
    h("option", { value: "pipeline" }, "Pipeline"),
    h("option", { value: "agent" }, "Agent"),
  );
  const nameSel = h("select", { id: "chat-name" });
  const collSel = h("select", { id: "chat-collection" });
  // "" = the pipeline's own model; anything else rides as `llm` on each chat frame.
  const modelSel = h("select", { id: "chat-model" }, h("option", { value: "" }, "Pipeline default"));
  const toolbar = h(
    "div",
    { class: "toolbar", role: "group", "aria-label": "What to chat with" },
    field("Kind", kindSel),
    field("Pipeline or agent", nameSel),
    field("Collection", collSel),
    field("Model", modelSel),
  );

  // --- messages and composer --------------------------------------------------
  const log = h("div", { class: "messages", role: "log", "aria-live": "polite", "aria-label": "Messages" });
  const input = h("textarea", {
    id: "chat-input",
    rows: "2",
    placeholder: "Ask about your documents…  (Enter sends, Shift+Enter adds a line)",
  });
  const send = h("button", { type: "submit", class: "primary", id: "chat-send" }, "Send");
  const stop = h("button", { type: "button", id: "chat-stop", disabled: true }, "Stop");
  const composer = h(
    "form",
    { class: "composer" },
    h("label", { for: "chat-input", class: "visually-hidden" }, "Message"),
    input,
    h("div", { class: "composer-buttons" }, send, stop),
  );
  const chat = h("section", { class: "chat", "aria-label": "Chat" }, toolbar, log, composer);
  root.appendChild(h("div", { class: "chat-layout" }, sidebar, chat, dialog.el));

  let choices: { pipelines: string[]; agents: string[] } = { pipelines: [target.name], agents: [] };

  function fillNames(): void {
    const names = target.kind === "agent" ? choices.agents : choices.pipelines;
    clear(nameSel);
    for (const n of names) nameSel.appendChild(h("option", { value: n }, n));
    if (!names.length) nameSel.appendChild(h("option", { value: "" }, "(none offered)"));
    if (names.includes(target.name)) nameSel.value = target.name;
    else target.name = nameSel.value;
  }

  function saveTarget(): void {
    target = { kind: kindSel.value as Target["kind"], name: nameSel.value, collection: collSel.value };
    localStorage.setItem(PREFS, JSON.stringify(target));
  }

  kindSel.value = target.kind;
  kindSel.addEventListener("change", () => {
    target.kind = kindSel.value as Target["kind"];
    fillNames();
    saveTarget();
  });
  nameSel.addEventListener("change", saveTarget);
  collSel.addEventListener("change", saveTarget);

  void loadChoices().then((c) => {
    choices = c;
    kindSel.querySelector<HTMLOptionElement>('option[value="agent"]')!.disabled = !c.agents.length;
    fillNames();
  });
  void loadCollections()
    .then((cols) => {
      clear(collSel);
      collSel.appendChild(h("option", { value: "" }, "(no collection)"));
      for (const c of cols) collSel.appendChild(h("option", { value: c }, c));
      if (cols.includes(target.collection)) collSel.value = target.collection;
      else if (cols.length) collSel.value = cols.includes("docs") ? "docs" : cols[0];
      target.collection = collSel.value;
    })
    .catch((exc: ApiError) => toast(`Collections: ${exc.message}`, "error"));

  // --- model picker -----------------------------------------------------------
  let models: ModelCard[] = [];
  function fillModels(want: string): void {
    clear(modelSel);
    modelSel.appendChild(h("option", { value: "" }, "Pipeline default"));
    const base = models.filter((m) => !isFineTune(m));
    const tuned = models.filter(isFineTune);
    if (base.length) modelSel.appendChild(h("optgroup", { label: "Base models" }, base.map((m) => h("option", { value: m.id }, m.id))));
    if (tuned.length) modelSel.appendChild(h("optgroup", { label: "Fine-tunes" }, tuned.map((m) => h("option", { value: m.id }, m.id))));
    // A conversation may remember a model no longer listed (deleted since): show it as such.
    if (want && !models.some((m) => m.id === want)) modelSel.appendChild(h("option", { value: want }, `${want} (not listed)`));
    modelSel.value = want;
  }
  void loadModels()
    .then((ms) => {
      models = ms;
      fillModels(modelSel.value);
    })
    .catch(() => undefined /* no model list: the pipeline's default model still answers */);

  // --- conversations ----------------------------------------------------------
  async function refreshConversations(): Promise<void> {
    let convs: Conversation[];
    try {
      convs = listOf<Conversation>(await api("/v1/conversations"), "conversations");
    } catch (exc) {
      toast(`Conversations: ${(exc as Error).message}`, "error");
      return;
    }
    clear(convList);
    if (!convs.length) convList.appendChild(h("li", { class: "muted empty" }, "No conversations yet."));
    for (const c of convs) convList.appendChild(convItem(c));
  }

  function convItem(c: Conversation): HTMLElement {
    const id = convId(c);
    const label = c.title?.trim() || "Untitled";
    const link = h(
      "a",
      { href: `#/chat/${enc(id)}`, class: "conv-link", "aria-current": id === conversationId ? "page" : false },
      label,
    );
    const rename = h("button", { type: "button", class: "icon", "aria-label": `Rename “${label}”`, title: "Rename" }, "✎");
    const del = h("button", { type: "button", class: "icon", "aria-label": `Delete “${label}”`, title: "Delete" }, "✕");
    const li = h("li", { class: "conv", "data-id": id }, link, rename, del);
    rename.addEventListener("click", () => {
      const box = h("input", { type: "text", value: label, maxlength: "120", "aria-label": "New title", class: "rename-input" });
      const form = h("form", { class: "rename" }, box);
      li.replaceChildren(form);
      box.focus();
      box.select();
      // Enter, Escape and blur can each end the edit (removing the input blurs it): act once.
      let ended = false;
      const finish = async (save: boolean) => {
        if (ended || !li.isConnected) return;
        ended = true;
        const title = box.value.trim();
        if (save && title && title !== label) {
          try {
            await api(`/v1/conversations/${enc(id)}`, { method: "PATCH", json: { title } });
          } catch (exc) {
            toast(`Rename failed: ${(exc as Error).message}`, "error");
          }
        }
        await refreshConversations();
        convList.querySelector<HTMLElement>(`li[data-id="${CSS.escape(id)}"] .conv-link`)?.focus();
      };
      form.addEventListener("submit", (ev) => {
        ev.preventDefault();
        void finish(true);
      });
      box.addEventListener("keydown", (ev) => {
        if (ev.key === "Escape") void finish(false);
      });
      box.addEventListener("blur", () => void finish(true), { once: true });
    });
    del.addEventListener("click", async () => {
      if (!confirm(`Delete the conversation “${label}”?`)) return;
      try {
        await api(`/v1/conversations/${enc(id)}`, { method: "DELETE" });
      } catch (exc) {
        toast(`Delete failed: ${(exc as Error).message}`, "error");
        return;
      }
      if (id === conversationId) location.hash = "#/chat";
      await refreshConversations();
      newButton.focus();
    });
    return li;
  }

  newButton.addEventListener("click", () => {
    location.hash = "#/chat";
    showConversation(null);
    input.focus();
  });

  // --- messages ---------------------------------------------------------------
  function userMessage(text: string): HTMLElement {
    return h("article", { class: "msg user" }, h("h3", { class: "visually-hidden" }, "You"), h("p", null, text));
  }

  interface AnswerView {
    el: HTMLElement;
    text: () => string;
    citations: () => Citation[];
    setMessageId: (id: string, feedback?: StoredMessage["feedback"]) => void;
    setText: (text: string) => void;
    addCitation: (c: Citation) => void;
    addStep: (s: Step) => void;
    /** A tool call held for the user: its tool, its arguments and Approve / Deny. */
    addApproval: (a: ApprovalRequired) => void;
    setError: (m: string) => void;
    finish: () => void;
    /** The server replaces what streamed so far (the groundedness guard's "reset" event). */
    reset: () => void;
    /** The guard's verdict from "done": an extractive answer, or sentences no source supports. */
    setGrounding: (kind: unknown, unsupported: unknown) => void;
  }

  function answerMessage(collection: string): AnswerView {
    const body = h("div", { class: "md" });
    const stepsList = h("ol", { class: "steps" });
    const steps = h("details", { class: "steps-box", open: true, hidden: true }, h("summary", null, "Agent steps"), stepsList);
    const chips = h("div", { class: "chips", role: "list", "aria-label": "Citations", hidden: true });
    const error = h("p", { class: "error", role: "alert", hidden: true });
    const actions = h("div", { class: "answer-actions", hidden: true });
    const approvals = h("div", { class: "approvals" });
    const el = h(
      "article",
      { class: "msg assistant", "aria-busy": "true" },
      h("h3", { class: "visually-hidden" }, "Answer"),
      steps,
      approvals,
      body,
      chips,
      error,
      actions,
    );
    const cites = new Map<number, Citation>();
    let text = "";
    let pending = false;
    let unsupported: string[] = [];
    const note = h("p", { class: "grounding-note", hidden: true });
    el.insertBefore(note, chips);
    // Dims the sentences no source supports (shown, but not to be trusted).
    const dim = () => {
      if (!unsupported.length) return;
      const walker = document.createTreeWalker(body, NodeFilter.SHOW_TEXT);
      const nodes: Text[] = [];
      for (let n = walker.nextNode(); n; n = walker.nextNode()) nodes.push(n as Text);
      for (const node of nodes) {
        for (const sentence of unsupported) {
          const at = node.data.indexOf(sentence);
          if (at < 0) continue;
          const rest = node.splitText(at);
          rest.splitText(sentence.length);
          const span = h("span", { class: "unsupported", title: "No source supports this sentence" });
          rest.replaceWith(span);
          span.appendChild(rest);
          break;
        }
      }
    };
    const render = () => {
      pending = false;
      body.replaceChildren(renderMarkdown(text));
      linkCitations(body, (n) => {
        const c = cites.get(n);
        if (!c) return null;
        return h(
          "button",
          { type: "button", class: "cite-ref", "aria-label": `Citation ${n}: ${c.title ?? ""}`, onclick: () => dialog.open(c, collection) },
          `[${n}]`,
        );
      });
      dim();
    };
    const schedule = () => {
      if (!pending) {
        pending = true;
        requestAnimationFrame(render);
      }
    };
    const view: AnswerView = {
      el,
      text: () => text,
      citations: () => [...cites.values()],
      setMessageId(id, feedback) {
        if (el.dataset.messageId === id) return;
        el.dataset.messageId = id;
        actions.hidden = false;
        actions.replaceChildren(...feedbackControls(view, id, collection, feedback));
      },
      setText(t) {
        text = t;
        schedule();
      },
      addCitation(c) {
        if (cites.has(c.index)) return;
        cites.set(c.index, c);
        chips.hidden = false;
        const chip = h(
          "button",
          { type: "button", class: "chip", role: "listitem", title: c.text?.slice(0, 200) ?? "" },
          h("span", { class: "chip-n" }, String(c.index)),
          " ",
          c.title || c.document_id || "source",
        );
        chip.addEventListener("click", () => dialog.open(c, collection));
        chips.appendChild(chip);
        schedule();
      },
      addStep(s) {
        // A stored turn lists its held call among its steps.
        if ((s as Record<string, unknown>).type === "approval_required") {
          view.addApproval(s as unknown as ApprovalRequired);
          return;
        }
        steps.hidden = false;
        stepsList.appendChild(stepView(s));
      },
      addApproval(a) {
        if (typeof a.approval_id !== "string") return;
        approvals.appendChild(approvalView(a, collection, el));
      },
      setError(m) {
        error.hidden = false;
        error.textContent = m;
      },
      reset() {
        text = "";
        cites.clear();
        chips.replaceChildren();
        chips.hidden = true;
        schedule();
      },
      setGrounding(kind, flagged) {
        if (kind === "extractive") {
          note.hidden = false;
          note.textContent = "The model's answer was not usable; these are the source sentences that answer it.";
        }
        unsupported = Array.isArray(flagged)
          ? flagged
              .map((u) => String((u as { text?: unknown }).text ?? "").replace(/\s*\[[^\]]*\]/g, "").replace(/[.!?]+$/, "").trim())
              .filter((t) => t.length > 0)
          : [];
        schedule();
      },
      finish() {
        el.setAttribute("aria-busy", "false");
        render();
        // Fold the steps away under a good answer; leave them open when the turn failed.
        if (stepsList.children.length && error.hidden) steps.open = false;
      },
    };
    return view;
  }

  /**
   * A held tool call: what the agent wants to run (arguments shown as text, never markup) and
   * Approve / Deny. Either posts the decision (POST /v1/agents/approvals/{id}) and streams the
   * continued run into a new answer below `after`.
   */
  function approvalView(a: ApprovalRequired, collection: string, after: HTMLElement): HTMLElement {
    const args = typeof a.arguments === "string" ? a.arguments : JSON.stringify(a.arguments ?? {}, null, 2);
    const approve = h("button", { type: "button", class: "primary approve" }, "Approve");
    const deny = h("button", { type: "button", class: "deny" }, "Deny");
    const status = h("p", { class: "small muted approval-status", role: "status" });
    const expires = typeof a.expires_at === "number" ? ` Decide before ${new Date(a.expires_at * 1000).toLocaleTimeString()}.` : "";
    const box = h(
      "section",
      { class: "approval", "aria-label": `Approve ${a.tool}` },
      h("p", null, "The agent wants to call ", h("code", { class: "approval-tool" }, a.tool), " with:"),
      h("pre", { class: "approval-args" }, args),
      h("p", { class: "small muted" }, `It acts outside Tandem; nothing runs unless you approve.${expires}`),
      h("div", { class: "row-buttons" }, approve, deny),
      status,
    );
    const decide = async (yes: boolean) => {
      approve.disabled = deny.disabled = true;
      status.className = "small muted approval-status";
      status.textContent = yes ? "Approved: running the call…" : "Denied: the agent answers without it…";
      const next = answerMessage(collection);
      let failure = "";
      let text = "";
      let shown = false;
      try {
        for await (const ev of sse(`/v1/agents/approvals/${enc(a.approval_id)}`, {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ approve: yes, stream: true }),
        })) {
          let e: Record<string, unknown>;
          try {
            e = JSON.parse(ev.data);
          } catch {
            continue;
          }
          if (!shown) {
            after.after(next.el);
            shown = true;
          }
          if (e.type === "token") {
            text += String(e.text ?? "");
            next.setText(text);
          } else if (e.type === "citation") next.addCitation(e as unknown as Citation);
          else if (e.type === "step") {
            next.addStep(e as unknown as Step);
            if (e.kind === "final" && !text && typeof e.text === "string") {
              text = e.text;
              next.setText(text);
            }
          } else if (e.type === "approval_required") next.addApproval(e as unknown as ApprovalRequired);
          else if (e.type === "error") failure = String(e.message ?? "error");
          else if (e.type === "done") {
            for (const c of listOf<Citation>(e, "citations")) next.addCitation(c);
            if (typeof e.message_id === "string" && e.message_id) next.setMessageId(e.message_id);
          }
          scrollDown();
        }
      } catch (exc) {
        failure = (exc as Error).message;
        if (!shown) {
          // The decision was refused (expired, already decided): the buttons stay off.
          status.className = "small error approval-status";
          status.setAttribute("role", "alert");
          status.textContent = `Not run: ${failure}`;
          return;
        }
      }
      if (failure) next.setError(failure);
      next.finish();
      status.textContent = yes ? "Approved." : "Denied.";
    };
    approve.addEventListener("click", () => void decide(true));
    deny.addEventListener("click", () => void decide(false));
    return box;
  }

  /**
   * Thumbs, "edit answer" and "regenerate" under an answer that has a message_id. Feedback
   * goes over REST (POST /v1/feedback): the chat socket lives for one turn only, and these
   * act on answers of reopened conversations too. A new rating replaces the old one;
   * pressing the active thumb again withdraws it (DELETE /v1/feedback/{id}).
   */
  function feedbackControls(view: AnswerView, id: string, collection: string, initial?: StoredMessage["feedback"]): HTMLElement[] {
    let rating = initial && (initial.rating === 1 || initial.rating === -1) ? initial.rating : 0;
    const up = h("button", { type: "button", class: "icon thumb thumb-up", "aria-label": "Good answer", title: "Good answer" }, thumbIcon("up"));
    const down = h("button", { type: "button", class: "icon thumb thumb-down", "aria-label": "Bad answer", title: "Bad answer" }, thumbIcon("down"));
    const edit = h("button", { type: "button", class: "link edit-answer" }, "Edit answer");
    const regen = h("button", { type: "button", class: "link regenerate" }, "Regenerate");
    const state = h("span", { class: "fb-state small muted", role: "status" });
    const correctionBox = h("div", { class: "correction", hidden: true });
    const showCorrection = (text: string | null | undefined) => {
      correctionBox.hidden = !text;
      correctionBox.replaceChildren(h("strong", null, "Your correction: "), h("span", { class: "correction-text" }, text ?? ""));
    };
    const paint = () => {
      up.setAttribute("aria-pressed", String(rating === 1));
      down.setAttribute("aria-pressed", String(rating === -1));
    };
    paint();
    showCorrection(initial?.correction);

    const send = async (body: Record<string, unknown>): Promise<boolean> => {
      try {
        await api("/v1/feedback", { json: { message_id: id, ...body } });
        return true;
      } catch (exc) {
        state.textContent = `Feedback not saved: ${(exc as Error).message}`;
        state.className = "fb-state small error";
        return false;
      }
    };
    const rate = async (r: 1 | -1) => {
      up.disabled = down.disabled = true;
      state.className = "fb-state small muted";
      try {
        if (rating === r) {
          await api(`/v1/feedback/${enc(id)}`, { method: "DELETE" });
          rating = 0;
          showCorrection(null);
          state.textContent = "Feedback removed.";
        } else if (await send({ rating: r })) {
          rating = r;
          showCorrection(null);
          state.textContent = r === 1 ? "Thanks: marked as a good answer." : "Thanks: marked as a bad answer.";
        }
      } catch (exc) {
        state.textContent = `Feedback not removed: ${(exc as Error).message}`;
        state.className = "fb-state small error";
      } finally {
        up.disabled = down.disabled = false;
        paint();
      }
    };
    up.addEventListener("click", () => void rate(1));
    down.addEventListener("click", () => void rate(-1));

    edit.addEventListener("click", () => {
      if (view.el.querySelector(".edit-form")) return;
      const box = h("textarea", { class: "edit-text", rows: "6", maxlength: "20000" });
      box.value = correctionBox.hidden ? view.text() : (correctionBox.querySelector(".correction-text")?.textContent ?? "");
      const save = h("button", { type: "submit", class: "primary" }, "Save correction");
      const cancel = h("button", { type: "button" }, "Cancel");
      const form = h(
        "form",
        { class: "edit-form" },
        field("Corrected answer", box, "What the answer should have said. Saved as a thumbs down with this correction."),
        h("div", { class: "row-buttons" }, save, cancel),
      );
      cancel.addEventListener("click", () => {
        form.remove();
        edit.focus();
      });
      form.addEventListener("submit", async (ev) => {
        ev.preventDefault();
        const correction = box.value.trim();
        if (!correction) {
          box.focus();
          return;
        }
        save.disabled = true;
        state.className = "fb-state small muted";
        if (await send({ rating: -1, correction })) {
          rating = -1;
          paint();
          showCorrection(correction);
          state.textContent = "Correction saved.";
          form.remove();
          edit.focus();
        } else save.disabled = false;
      });
      view.el.appendChild(form);
      box.focus();
    });

    regen.addEventListener("click", async () => {
      regen.disabled = true;
      state.className = "fb-state small muted";
      state.textContent = "";
      // The new draft streams into the right-hand column (a CPU model takes a while).
      const drafts = draftsView(id, view.text(), view.citations(), collection);
      view.el.after(drafts.el);
      drafts.el.scrollIntoView({ block: "nearest" });
      let text = "";
      let draftId = "";
      let failure = "";
      try {
        for await (const ev of sse(`/v1/messages/${enc(id)}/regenerate`, {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ stream: true }),
        })) {
          let e: Record<string, unknown>;
          try {
            e = JSON.parse(ev.data);
          } catch {
            continue;
          }
          if (e.type === "token") {
            text += String(e.text ?? "");
            drafts.setText(text);
          } else if (e.type === "citation") drafts.addCitation(e as unknown as Citation);
          else if (e.type === "step" && e.kind === "final" && !text && typeof e.text === "string") {
            text = e.text;
            drafts.setText(text);
          } else if (e.type === "error") failure = String(e.message ?? "error");
          else if (e.type === "done") {
            for (const c of listOf<Citation>(e, "citations")) drafts.addCitation(c);
            if (typeof e.message_id === "string") draftId = e.message_id;
          }
        }
        if (!failure && !draftId) failure = "the server sent no message_id for the new draft";
      } catch (exc) {
        failure = (exc as Error).message;
      } finally {
        regen.disabled = false;
      }
      if (failure) drafts.fail(`Regenerate failed: ${failure}`);
      else drafts.finish(draftId);
    });

    // The correction, when there is one, is the reference a right answer states.
    const addEval = addToEvaluation(id, () => (correctionBox.hidden ? view.text() : (correctionBox.querySelector(".correction-text")?.textContent ?? "")), () => view.el);
    return [h("div", { class: "fb-buttons", role: "group", "aria-label": "Feedback on this answer" }, up, down, edit, regen, addEval, state), correctionBox];
  }

  /**
   * Two drafts of one prompt side by side: the answer as it was, and a new one that streams in.
   * Picking one records the preference (POST /v1/messages/{chosen}/choose {"over": other}).
   */
  function draftsView(firstId: string, firstText: string, firstCites: Citation[], collection: string) {
    const el = h("section", { class: "drafts", "aria-label": "Two drafts: choose the better one" });
    const status = h("p", { class: "small muted drafts-status", role: "status" });
    let secondId = "";
    const column = (label: string, text: string) => {
      const body = h("div", { class: "md" });
      const cites = new Map<number, Citation>();
      const chips = h("div", { class: "chips", role: "list", "aria-label": "Citations", hidden: true });
      const render = (t: string) => {
        body.replaceChildren(renderMarkdown(t));
        linkCitations(body, (n) => {
          const c = cites.get(n);
          return c ? h("button", { type: "button", class: "cite-ref", "aria-label": `Citation ${n}: ${c.title ?? ""}`, onclick: () => dialog.open(c, collection) }, `[${n}]`) : null;
        });
      };
      const pick = h("button", { type: "button", class: "choose", disabled: true }, `Choose ${label.toLowerCase()}`);
      const col = h("article", { class: "draft", "aria-busy": "false" }, h("h3", null, label), body, chips, pick);
      const addCitation = (c: Citation) => {
        if (cites.has(c.index)) return;
        cites.set(c.index, c);
        chips.hidden = false;
        const chip = h("button", { type: "button", class: "chip", role: "listitem" }, h("span", { class: "chip-n" }, String(c.index)), " ", c.title || c.document_id || "source");
        chip.addEventListener("click", () => dialog.open(c, collection));
        chips.appendChild(chip);
      };
      render(text);
      return { col, pick, render, addCitation };
    };
    const first = column("Draft 1", firstText);
    for (const c of firstCites) first.addCitation(c);
    first.render(firstText);
    const second = column("Draft 2", "");
    first.col.dataset.messageId = firstId;
    second.col.setAttribute("aria-busy", "true");
    const choose = async (which: typeof first, chosen: string, over: string, label: string) => {
      first.pick.disabled = second.pick.disabled = true;
      try {
        await api(`/v1/messages/${enc(chosen)}/choose`, { json: { over } });
        which.col.classList.add("chosen");
        which.pick.textContent = "Chosen";
        status.className = "small muted drafts-status";
        status.textContent = `${label} chosen: recorded as preferred over the other.`;
      } catch (exc) {
        status.className = "small error drafts-status";
        status.textContent = `Not recorded: ${(exc as Error).message}`;
        first.pick.disabled = second.pick.disabled = false;
      }
    };
    first.pick.addEventListener("click", () => void choose(first, firstId, secondId, "Draft 1"));
    second.pick.addEventListener("click", () => void choose(second, secondId, firstId, "Draft 2"));
    status.textContent = "Writing another draft…";
    el.append(h("h3", { class: "drafts-title" }, "Which answer is better?"), h("div", { class: "drafts-grid" }, first.col, second.col), status);
    let pending = false;
    let latest = "";
    return {
      el,
      setText(t: string) {
        latest = t;
        if (pending) return;
        pending = true;
        requestAnimationFrame(() => {
          pending = false;
          second.render(latest);
        });
      },
      addCitation: second.addCitation,
      finish(id: string) {
        secondId = id;
        second.col.dataset.messageId = id;
        second.col.setAttribute("aria-busy", "false");
        second.render(latest);
        first.pick.disabled = second.pick.disabled = false;
        status.textContent = "";
      },
      fail(message: string) {
        second.col.setAttribute("aria-busy", "false");
        status.className = "small error drafts-status";
        status.setAttribute("role", "alert");
        status.textContent = message;
      },
    };
  }

  function scrollDown(): void {
    const nearBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 120;
    if (nearBottom) log.scrollTop = log.scrollHeight;
  }

  /** Shows a conversation; `focus` names one of its answers to scroll to and mark (#/chat/<id>/<message>). */
  async function showConversation(id: string | null, focus: string | null = null): Promise<void> {
    conversationId = id;
    for (const a of convList.querySelectorAll("a.conv-link")) a.removeAttribute("aria-current");
    if (id) convList.querySelector(`li[data-id="${CSS.escape(id)}"] a`)?.setAttribute("aria-current", "page");
    clear(log);
    if (!id) {
      log.appendChild(
        h(
          "div",
          { class: "empty-chat" },
          h("h2", null, "Ask your documents"),
          h("p", null, "Pick a collection above and ask a question; answers cite the passages they use."),
        ),
      );
      return;
    }
    try {
      const conv = await api<Record<string, unknown>>(`/v1/conversations/${enc(id)}`);
      if (conversationId !== id) return;
      // Citations point into the collection the conversation used.
      const collection = typeof conv.collection === "string" && conv.collection ? conv.collection : target.collection;
      // A reopened conversation goes on with the model it used.
      fillModels(typeof conv.llm === "string" ? conv.llm : "");
      for (const m of listOf<StoredMessage>(conv, "messages")) {
        if (m.role === "user") log.appendChild(userMessage(m.content));
        else if (m.role === "assistant") {
          const view = answerMessage(collection);
          for (const c of m.citations ?? []) view.addCitation(c);
          for (const s of m.steps ?? []) view.addStep(s);
          view.setText(m.content);
          view.finish();
          if (m.message_id) view.setMessageId(m.message_id, m.feedback);
          log.appendChild(view.el);
        }
      }
      log.scrollTop = log.scrollHeight;
      if (focus) focusAnswer(focus);
    } catch (exc) {
      if ((exc as ApiError).status === 404) {
        toast("That conversation no longer exists.", "error");
        location.hash = "#/chat";
      } else toast(`Conversation: ${(exc as Error).message}`, "error");
    }
  }

  function setStreaming(on: boolean): void {
    streaming = on;
    send.disabled = on;
    stop.disabled = !on;
    input.setAttribute("aria-disabled", String(on));
  }

  function ask(message: string): void {
    if (!signedIn()) return;
    const key = getKey();
    saveTarget();
    const collection = target.collection;
    const llm = modelSel.value;
    const empty = log.querySelector(".empty-chat");
    empty?.remove();
    log.appendChild(userMessage(message));
    const view = answerMessage(collection);
    log.appendChild(view.el);
    log.scrollTop = log.scrollHeight;
    setStreaming(true);
    let text = "";
    let finished = false;
    // a provider sign-in has no key here: the browser sends the session cookie with the handshake
    const ws = new WebSocket(wsUrl("/v1/ws/chat"), key ? ["tandem.bearer", key] : []);
    socket = ws;
    const done = (error?: string) => {
      if (finished) return;
      finished = true;
      if (error) view.setError(error);
      view.finish();
      setStreaming(false);
      if (socket === ws) socket = null;
      if (ws.readyState === WebSocket.OPEN) ws.close(1000);
      void refreshConversations();
      if (!disposed) input.focus();
    };
    ws.onopen = () => {
      const msg: Record<string, unknown> = { [target.kind]: target.name, message };
      if (collection) msg.collection = collection;
      if (conversationId) msg.conversation_id = conversationId;
      if (llm) msg.llm = llm;
      ws.send(JSON.stringify(msg));
    };
    ws.onmessage = (ev) => {
      let e: Record<string, unknown>;
      try {
        e = JSON.parse(String(ev.data));
      } catch {
        return;
      }
      switch (e.type) {
        case "conversation":
          if (typeof e.conversation_id === "string" && e.conversation_id !== conversationId) {
            conversationId = e.conversation_id;
            // Put the conversation in the URL without rebuilding the page (onRoute says "handled").
            location.hash = `#/chat/${enc(conversationId)}`;
            void refreshConversations();
          }
          break;
        case "token":
          text += String(e.text ?? "");
          view.setText(text);
          scrollDown();
          break;
        case "reset":
          text = "";
          view.reset();
          break;
        case "citation":
          view.addCitation(e as unknown as Citation);
          break;
        case "step":
          view.addStep(e as unknown as Step);
          if (e.kind === "final" && !text && typeof e.text === "string") {
            text = e.text;
            view.setText(text);
          }
          scrollDown();
          break;
        case "approval_required":
          view.addApproval(e as unknown as ApprovalRequired);
          scrollDown();
          break;
        case "error":
          done(String(e.message ?? "error"));
          break;
        case "done":
          for (const c of listOf<Citation>(e, "citations")) view.addCitation(c);
          view.setGrounding(e.kind, e.unsupported);
          done();
          if (typeof e.message_id === "string" && e.message_id) view.setMessageId(e.message_id);
          break;
      }
    };
    ws.onerror = () => done("The connection to the chat service failed.");
    ws.onclose = (ev) => {
      if (!finished) {
        const reason = ev.code === 1008 || ev.code === 4401 ? "The API key was refused." : `connection closed (${ev.code})`;
        done(text ? undefined : reason);
      }
    };
  }

  composer.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const message = input.value.trim();
    if (!message || streaming) return;
    if (!target.name) {
      toast("Choose a pipeline or agent first.", "error");
      nameSel.focus();
      return;
    }
    input.value = "";
    ask(message);
  });
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      composer.requestSubmit();
    }
  });
  stop.addEventListener("click", () => {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "stop" }));
    stop.disabled = true;
  });

  void refreshConversations();
  function focusAnswer(messageId: string): void {
    for (const el of log.querySelectorAll(".focused")) el.classList.remove("focused");
    const el = log.querySelector<HTMLElement>(`[data-message-id="${CSS.escape(messageId)}"]`);
    if (!el) return;
    el.classList.add("focused");
    el.setAttribute("tabindex", "-1");
    el.scrollIntoView({ block: "center" });
    el.focus({ preventScroll: true });
  }

  void showConversation(conversationId, args[1] ?? null);
  input.focus();

  return {
    onRoute(newArgs: string[]) {
      const id = newArgs[0] ?? null;
      const focus = newArgs[1] ?? null;
      if (id !== conversationId) void showConversation(id, focus);
      else if (focus) focusAnswer(focus);
      return true;
    },
    dispose() {
      disposed = true;
      socket?.close(1000);
    },
  };
}
