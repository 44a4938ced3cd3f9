// Documents: collections (list, create, delete), uploads with per-file progress that lasts
// until ingestion has finished, per-file errors, and the collection's documents.
import { api, ApiError, enc, listOf, retrieval, uploadWithProgress } from "../api";
import { clear, field, formatBytes, h, toast } from "../dom";
import { followJob, isSuccess, isTerminal, jobStatus, progressOf, type Follow, type JobState } from "../jobs";

const ACCEPT = ".txt,.md,.markdown,.html,.htm,.pdf,.docx,.jsonl";
const PAGE = 50;

interface Collection {
  name: string;
  documents?: number;
  document_count?: number;
  chunks?: number;
  chunk_count?: number;
  embedding_model?: string;
}

interface Doc {
  id?: string;
  document_id?: string;
  title?: string;
  chunks?: number;
  chunk_count?: number;
  metadata?: Record<string, unknown>;
}

/** The job id in an upload answer, if ingestion went to the background. */
function jobIdOf(resp: unknown): string | null {
  if (!resp || typeof resp !== "object") return null;
  const r = resp as Record<string, unknown>;
  if (typeof r.job_id === "string") return r.job_id;
  const job = r.job as Record<string, unknown> | undefined;
  if (job && typeof job.id === "string") return job.id;
  if (typeof r.id === "string" && (r.status || r.state) && !r.documents) return r.id;
  return null;
}

export function documentsPage(root: HTMLElement, args: string[]) {
  let selected: string | null = args[0] ?? null;
  const follows = new Set<Follow>();

  // --- collections --------------------------------------------------------------
  const collList = h("ul", { class: "coll-list", "aria-label": "Collections" });
  const newName = h("input", {
    type: "text",
    id: "new-collection",
    required: true,
    pattern: "[A-Za-z0-9][A-Za-z0-9_.\\-]{0,63}",
    placeholder: "e.g. handbook",
    autocomplete: "off",
  });
  const createErr = h("p", { class: "error", role: "alert" });
  const createForm = h(
    "form",
    { class: "create-collection", "aria-label": "Create a collection" },
    field("New collection", newName, "Letters, digits, '_', '.', '-'"),
    h("button", { type: "submit", class: "primary" }, "Create"),
    createErr,
  );
  const aside = h(
    "aside",
    { class: "sidebar", "aria-label": "Collections" },
    h("h2", null, "Collections"),
    collList,
    createForm,
  );

  // --- the selected collection -----------------------------------------------------
  const heading = h("h1", { id: "docs-title" }, "Documents");
  const picker = h("input", { type: "file", id: "file-picker", multiple: true, accept: ACCEPT, class: "visually-hidden" });
  const pickLabel = h("label", { for: "file-picker", class: "button" }, "Choose files");
  const drop = h(
    "div",
    { class: "dropzone", id: "dropzone" },
    h("p", null, "Drop files here, or "),
    pickLabel,
    picker,
    h("p", { class: "muted" }, "Markdown, text, HTML, PDF, DOCX or JSONL; several at once."),
  );
  const uploads = h("ul", { class: "uploads", "aria-label": "Uploads", "aria-live": "polite" });
  const docsBody = h("tbody");
  const docsTable = h(
    "table",
    { class: "docs", "aria-labelledby": "docs-list-title" },
    h("thead", null, h("tr", null, h("th", { scope: "col" }, "Title"), h("th", { scope: "col" }, "Id"), h("th", { scope: "col" }, "Chunks"), h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions")))),
    docsBody,
  );
  const more = h("button", { type: "button", hidden: true }, "Load more");
  const deleteColl = h("button", { type: "button", class: "danger" }, "Delete collection");
  const panel = h(
    "section",
    { class: "panel", "aria-labelledby": "docs-title" },
    h("div", { class: "panel-head" }, heading, deleteColl),
    drop,
    uploads,
    h("h2", { id: "docs-list-title" }, "Documents in this collection"),
    docsTable,
    more,
  );
  const empty = h("section", { class: "panel empty" }, h("h1", null, "Documents"), h("p", null, "Create a collection, or pick one on the left, then add files to it."));
  root.appendChild(h("div", { class: "two-col" }, aside, panel, empty));

  async function refreshCollections(): Promise<string[]> {
    let cols: Collection[] = [];
    try {
      cols = listOf<Collection>(await api(retrieval("/collections")), "collections");
    } catch (exc) {
      toast(`Collections: ${(exc as Error).message}`, "error");
    }
    clear(collList);
    if (!cols.length) collList.appendChild(h("li", { class: "muted empty" }, "No collections yet."));
    for (const c of cols) {
      const count = c.documents ?? c.document_count;
      collList.appendChild(
        h(
          "li",
          null,
          h(
            "a",
            { href: `#/documents/${enc(c.name)}`, "aria-current": c.name === selected ? "page" : false },
            c.name,
            count !== undefined ? h("span", { class: "count" }, ` ${count}`) : null,
          ),
        ),
      );
    }
    return cols.map((c) => c.name);
  }

  createForm.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    createErr.textContent = "";
    const name = newName.value.trim();
    try {
      await api(retrieval("/collections"), { json: { name } });
      newName.value = "";
      toast(`Collection “${name}” created.`);
      location.hash = `#/documents/${enc(name)}`;
      await refreshCollections();
    } catch (exc) {
      createErr.textContent = (exc as Error).message;
      newName.focus();
    }
  });

  deleteColl.addEventListener("click", async () => {
    if (!selected || !confirm(`Delete the collection “${selected}” and all its documents?`)) return;
    try {
      await api(retrieval(`/collections/${enc(selected)}`), { method: "DELETE" });
      toast(`Collection “${selected}” deleted.`);
      location.hash = "#/documents";
      await refreshCollections();
    } catch (exc) {
      toast(`Delete failed: ${(exc as Error).message}`, "error");
    }
  });

  // --- documents ------------------------------------------------------------------
  let offset = 0;
  // Uploads finishing together each reload the list: only the latest load may draw it.
  let generation = 0;
  async function loadDocs(reset: boolean): Promise<void> {
    if (!selected) return;
    const coll = selected;
    const mine = reset ? ++generation : generation;
    const from = reset ? 0 : offset;
    let data: unknown;
    try {
      data = await api(retrieval(`/collections/${enc(coll)}/documents?limit=${PAGE}&offset=${from}`));
    } catch (exc) {
      if (coll === selected) toast(`Documents: ${(exc as Error).message}`, "error");
      return;
    }
    if (coll !== selected || mine !== generation) return;
    if (reset) clear(docsBody);
    offset = from;
    const docs = listOf<Doc>(data, "documents");
    offset += docs.length;
    for (const d of docs) docsBody.appendChild(docRow(coll, d));
    if (!docsBody.children.length) docsBody.appendChild(h("tr", null, h("td", { colspan: "4", class: "muted" }, "No documents yet.")));
    const total = (data as Record<string, unknown>)?.total;
    more.hidden = typeof total === "number" ? offset >= total : docs.length < PAGE;
  }

  function docRow(coll: string, d: Doc): HTMLElement {
    const id = d.id ?? d.document_id ?? "";
    const title = d.title || (d.metadata?.filename as string) || id;
    const del = h("button", { type: "button", class: "icon danger", "aria-label": `Delete ${title}`, title: "Delete" }, "✕");
    const row = h("tr", { "data-id": id }, h("td", null, title), h("td", null, h("code", null, id)), h("td", null, String(d.chunks ?? d.chunk_count ?? "")), h("td", null, del));
    del.addEventListener("click", async () => {
      if (!confirm(`Delete “${title}”?`)) return;
      try {
        await api(retrieval(`/collections/${enc(coll)}/documents/${enc(id)}`), { method: "DELETE" });
        row.remove();
        toast(`Deleted “${title}”.`);
      } catch (exc) {
        toast(`Delete failed: ${(exc as Error).message}`, "error");
      }
    });
    return row;
  }
  more.addEventListener("click", () => void loadDocs(false));

  // --- uploads ----------------------------------------------------------------------
  function uploadFile(coll: string, file: File): void {
    const bar = h("progress", { max: "100", value: "0", "aria-label": `Progress of ${file.name}` });
    const state = h("span", { class: "state" }, "uploading");
    const item = h(
      "li",
      { class: "upload", "data-file": file.name, "data-state": "uploading" },
      h("span", { class: "name" }, file.name),
      h("span", { class: "size muted" }, formatBytes(file.size)),
      bar,
      state,
    );
    uploads.prepend(item);
    const set = (phase: string, label: string, pct?: number) => {
      item.dataset.state = phase;
      state.textContent = label;
      if (pct === undefined) bar.removeAttribute("value");
      else bar.value = pct;
    };
    const fail = (msg: string) => {
      set("error", "failed", 100);
      item.classList.add("failed");
      item.appendChild(h("p", { class: "error", role: "alert" }, msg));
    };
    const finish = () => {
      set("done", "done", 100);
      if (coll === selected) void loadDocs(true);
      void refreshCollections();
    };
    const form = new FormData();
    form.append("file", file, file.name);
    uploadWithProgress(retrieval(`/collections/${enc(coll)}/files`), form, (f) =>
      set("uploading", `uploading ${Math.round(f * 100)}%`, Math.round(f * 50)),
    )
      .then((resp) => {
        const jobId = jobIdOf(resp);
        if (!jobId) {
          finish();
          return;
        }
        item.dataset.job = jobId;
        set("ingesting", "ingesting", 50);
        const follow = followJob(retrieval(`/jobs/${enc(jobId)}`), retrieval(`/jobs/${enc(jobId)}/events`), (job: JobState) => {
          const p = progressOf(job);
          if (isTerminal(job)) {
            follows.delete(follow);
            follow.stop();
            if (isSuccess(job)) finish();
            else fail(String((job.error as Record<string, unknown>)?.message ?? job.error ?? `ingestion ${jobStatus(job)}`));
            return;
          }
          if (p) set("ingesting", `ingesting: ${p.done}/${p.total} chunks`, 50 + Math.round((50 * p.done) / p.total));
          else set("ingesting", `ingesting (${jobStatus(job) || "queued"})`, 50);
        });
        follows.add(follow);
      })
      .catch((exc: ApiError) => fail(exc.message));
  }

  function uploadAll(files: FileList | File[]): void {
    if (!selected) {
      toast("Choose a collection first.", "error");
      return;
    }
    for (const f of Array.from(files)) uploadFile(selected, f);
  }

  picker.addEventListener("change", () => {
    if (picker.files?.length) uploadAll(picker.files);
    picker.value = "";
  });
  drop.addEventListener("dragover", (ev) => {
    ev.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (ev) => {
    ev.preventDefault();
    drop.classList.remove("over");
    if (ev.dataTransfer?.files.length) uploadAll(ev.dataTransfer.files);
  });

  function show(name: string | null): void {
    selected = name;
    panel.hidden = !name;
    empty.hidden = Boolean(name);
    heading.textContent = name ? `Collection “${name}”` : "Documents";
    for (const a of collList.querySelectorAll("a")) {
      if (a.getAttribute("href") === `#/documents/${enc(name ?? "")}`) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
    if (name) void loadDocs(true);
  }

  void refreshCollections().then(() => show(selected));
  show(selected);

  return {
    onRoute(newArgs: string[]) {
      show(newArgs[0] ?? null);
      return true;
    },
    dispose() {
      for (const f of follows) f.stop();
    },
  };
}
