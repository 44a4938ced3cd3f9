// Documents: collections (list, create, delete), uploads with per-file progress that lasts
// until ingestion has finished, per-file errors, the collection's documents, and "Tune
// retrieval": an embedder fine-tuned for the collection, switched to only when it ranks better.
// The collection's sources (Git, web, folder) and their syncs are in sources.ts; who may read
// and write it (admins only) in access.ts.
import { accessPanel } from "../access";
import { api, ApiError, enc, listOf, retrieval, trainer, uploadWithProgress } from "../api";
import { caller, isAdmin } from "../caller";
import { clear, field, formatBytes, h, toast } from "../dom";
import { followJob, isSuccess, isTerminal, jobStatus, progressOf, type Follow, type JobState } from "../jobs";
import { sourcesPanel } from "../sources";

const ACCEPT =
  ".txt,.md,.markdown,.html,.htm,.pdf,.docx,.jsonl,.pptx,.xlsx,.csv,.tsv,.odt,.epub,.eml,.png,.jpg,.jpeg,.tif,.tiff";
const PAGE = 50;
// Tune retrieval: the base a tuning starts from unless the collection already uses one of the
// tenant's fine-tuned embedders, and where the last tuning job of each collection is kept.
const TUNE_BASE = "all-MiniLM-L6-v2";
const TUNED_PREFIX = "ft-emb-";
const TUNE_JOB = "tandem.tune.job.";

interface Collection {
  name: string;
  documents?: number;
  document_count?: number;
  chunks?: number;
  chunk_count?: number;
  embedding_model?: string;
  /** The embedder of the active index version (after a switch, not embedding_model). */
  embedder?: string;
}

/** What a tuning job reports about its apply step (see the trainer's job object). */
interface ApplyResult {
  applied?: boolean | null;
  yardstick?: string;
  held_out?: number;
  mode?: string;
  before?: number | null;
  after?: number | null;
  reason?: string;
  reindex_job?: string | null;
}

/** The embedder a tuning of this collection starts from. */
export function tuneBaseModel(coll: Collection | undefined): string {
  const current = coll?.embedder || coll?.embedding_model || "";
  return current.startsWith(TUNED_PREFIX) ? current : TUNE_BASE;
}

function fmt4(v: unknown): string {
  return typeof v === "number" && Number.isFinite(v) ? v.toFixed(4) : "–";
}

function errorText(err: unknown): string {
  if (typeof err === "string") return err;
  if (err && typeof err === "object" && typeof (err as Record<string, unknown>).message === "string") return (err as Record<string, string>).message;
  return "";
}

/** The apply step's figures (nDCG@10 before -> after) and its verdict. */
function applyView(apply: ApplyResult, model: string | null): HTMLElement {
  const what = [
    typeof apply.held_out === "number" ? `${apply.held_out} held-out queries` : "held-out queries",
    apply.yardstick ? `from ${apply.yardstick}` : "",
    apply.mode ? `${apply.mode} search` : "",
  ].filter(Boolean);
  let verdict: HTMLElement | null = null;
  if (apply.applied === true) {
    verdict = h("p", { class: "success", id: "tune-verdict" }, "Applied: the collection now uses ", h("code", null, model || "the new embedder"), ".");
  } else if (apply.applied === false) {
    verdict = h("p", { class: "tune-not-applied", id: "tune-verdict" }, `Not applied: ${apply.reason || "the new embedder did not rank better"}`);
  }
  return h(
    "div",
    { class: "tune-apply" },
    h("p", { class: "tune-figures", id: "tune-figures" }, `nDCG@10 ${fmt4(apply.before)} → ${fmt4(apply.after)}`),
    h("p", { class: "small muted" }, what.join(", ")),
    verdict,
  );
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
  let known = new Map<string, Collection>();

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
    h("p", { class: "muted" }, "Markdown, text, HTML, PDF (scans too), DOCX, PPTX, XLSX, CSV, TSV, ODT, EPUB, e-mail (.eml), JSONL or images (PNG, JPEG, TIFF); several at once."),
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
  // A sync adds, changes and removes documents: the list and the counts follow.
  const sources = sourcesPanel((coll) => {
    if (coll === selected) void loadDocs(true);
    void refreshCollections();
  });

  // --- tune retrieval ---------------------------------------------------------------
  const tuneToggle = h("button", { type: "button", id: "tune-toggle", "aria-expanded": "false", "aria-controls": "tune-panel" }, "Tune retrieval");
  const pairsPicker = h("input", { type: "file", id: "tune-pairs", accept: ".jsonl,.json" });
  const pairsMsg = h("p", { class: "small", id: "tune-upload", "aria-live": "polite" });
  const tuneStart = h("button", { type: "submit", class: "primary", id: "tune-start" }, "Start");
  const tuneErr = h("p", { class: "error", role: "alert", id: "tune-error" });
  const tuneRun = h("div", { class: "train-run", id: "tune-run", hidden: true });
  const tunePanel = h(
    "form",
    { class: "card tune-panel", id: "tune-panel", "aria-labelledby": "tune-title", hidden: true },
    h("h2", { id: "tune-title" }, "Tune retrieval"),
    h("p", { class: "muted small" }, "Fine-tunes an embedder for this collection, compares nDCG@10 on held-out queries with the current embedder and the new one, and switches the collection only when the new one ranks better."),
    field("Labelled pairs", pairsPicker, "optional: without a file, the collection's titles and headings are used"),
    h("p", { class: "muted small" }, 'JSONL rows {"query", "positive"} or {"query", "document_id"}, or BEIR.'),
    pairsMsg,
    tuneErr,
    tuneStart,
    tuneRun,
  );
  const access = accessPanel();
  void caller().then(
    (c) => (access.toggle.hidden = !isAdmin(c)),
    () => {},
  );
  const panel = h(
    "section",
    { class: "panel", "aria-labelledby": "docs-title" },
    h("div", { class: "panel-head" }, heading, h("div", { class: "row-buttons" }, access.toggle, tuneToggle, deleteColl)),
    access.el,
    tunePanel,
    drop,
    uploads,
    h("h2", { id: "docs-list-title" }, "Documents in this collection"),
    docsTable,
    more,
    sources.el,
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
    known = new Map(cols.map((c) => [c.name, c]));
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

  // --- tune retrieval ------------------------------------------------------------------
  let tuneFor: string | null = null;
  let tuneFollow: Follow | null = null;
  let tuneDone = true;

  function openTune(open: boolean): void {
    tunePanel.hidden = !open;
    tuneToggle.setAttribute("aria-expanded", String(open));
  }

  /** The panel as it starts for `coll`, following its remembered job if there is one. */
  function resetTune(coll: string | null): void {
    tuneFollow?.stop();
    tuneFollow = null;
    tuneFor = coll;
    tuneDone = true;
    pairsPicker.value = "";
    pairsMsg.textContent = tuneErr.textContent = "";
    tuneStart.disabled = false;
    tuneRun.hidden = true;
    clear(tuneRun);
    const last = coll ? sessionStorage.getItem(TUNE_JOB + coll) : null;
    openTune(Boolean(last));
    if (coll && last) followTune(coll, last);
  }

  tuneToggle.addEventListener("click", () => {
    const open = Boolean(tunePanel.hidden);
    openTune(open);
    if (open) pairsPicker.focus();
    // Closing the panel on a finished job forgets it; a running one is still followed.
    else if (tuneDone && tuneFor) {
      sessionStorage.removeItem(TUNE_JOB + tuneFor);
      tuneRun.hidden = true;
      clear(tuneRun);
    }
  });

  function followTune(coll: string, jobId: string): void {
    tuneFollow?.stop();
    tuneDone = false;
    const status = h("p", { class: "job-status", role: "status", "aria-live": "polite", id: "tune-status" }, "Status: queued");
    const bar = h("progress", { max: "1", value: "0", "aria-label": "Tuning progress" });
    const result = h("div", { class: "tune-result", id: "tune-result", "aria-live": "polite" });
    tuneRun.hidden = false;
    tuneRun.replaceChildren(h("h3", null, "Job ", h("a", { href: `#/training/${enc(jobId)}` }, jobId)), status, bar, result);
    tuneStart.disabled = true;
    const follow = followJob(trainer(`/jobs/${enc(jobId)}`), trainer(`/jobs/${enc(jobId)}/events`), (job: JobState) => {
      if (tuneFor !== coll || tuneFollow !== follow) return;
      const p = progressOf(job);
      status.textContent = `Status: ${jobStatus(job) || "queued"}${p ? ` · step ${p.done} of ${p.total}` : ""}`;
      status.dataset.status = jobStatus(job);
      if (p) {
        bar.max = p.total;
        bar.value = p.done;
      }
      const model = typeof job.fine_tuned_model === "string" ? job.fine_tuned_model : null;
      const apply = job.apply && typeof job.apply === "object" ? (job.apply as ApplyResult) : null;
      const parts: HTMLElement[] = [];
      if (apply) parts.push(applyView(apply, model));
      if (isTerminal(job)) {
        tuneDone = true;
        tuneStart.disabled = false;
        if (!isSuccess(job)) {
          const why = errorText(job.error) || `the job ended ${jobStatus(job)}`;
          parts.push(h("p", { class: "error", role: "alert" }, `Tuning failed: ${why}`));
        } else if (!apply) {
          parts.push(h("p", { class: "muted" }, model ? `Published as ${model}; the job reported no comparison.` : "The job finished without a comparison."));
        } else if (apply.applied === true) {
          void refreshCollections();
        }
      }
      result.replaceChildren(...parts);
    });
    tuneFollow = follow;
  }

  tunePanel.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const coll = selected;
    if (!coll) return;
    tuneErr.textContent = "";
    tuneStart.disabled = true;
    try {
      const body: Record<string, unknown> = { type: "embedder", base_model: TUNE_BASE, collection: coll, apply: true };
      // The collection's own view names the active embedder (the listing may not).
      let info = known.get(coll);
      try {
        info = { ...info, ...(await api<Collection>(retrieval(`/collections/${enc(coll)}`))) };
      } catch {
        /* the listing's fields will do */
      }
      body.base_model = tuneBaseModel(info);
      const file = pairsPicker.files?.[0];
      if (file) {
        const form = new FormData();
        form.append("file", file, file.name);
        pairsMsg.className = "small";
        pairsMsg.textContent = `Uploading ${file.name}…`;
        let obj: { id?: string; rows?: number; format?: string };
        try {
          obj = (await uploadWithProgress(trainer("/files"), form, (f) => (pairsMsg.textContent = `Uploading ${file.name}: ${Math.round(f * 100)}%`))) as typeof obj;
        } catch (exc) {
          pairsMsg.textContent = "";
          throw new ApiError(`${file.name}: ${(exc as Error).message}`, (exc as ApiError).status ?? 0);
        }
        if (!obj?.id) throw new ApiError(`${file.name}: the trainer returned no file id`, 0);
        pairsMsg.textContent = `${file.name}: ${obj.rows ?? "?"} rows, format ${obj.format ?? "?"} (id ${obj.id}).`;
        body.dataset = obj.id;
      }
      if (coll !== selected) return;
      const job = await api<JobState>(trainer("/jobs"), { json: body });
      const jobId = String(job.id ?? "");
      if (!jobId) throw new ApiError("the trainer started no job", 0);
      // Remembered first: coming back to the collection follows it even if the page moved on.
      sessionStorage.setItem(TUNE_JOB + coll, jobId);
      if (coll !== selected) return;
      toast(`Tuning job ${jobId} started for “${coll}”.`);
      followTune(coll, jobId);
    } catch (exc) {
      if (coll !== selected) return;
      tuneErr.textContent = (exc as Error).message;
      tuneStart.disabled = false;
    }
  });

  function show(name: string | null): void {
    if (name !== tuneFor) resetTune(name);
    sources.show(name);
    access.show(name);
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
      tuneFollow?.stop();
      sources.dispose();
    },
  };
}
