// A collection's sources on the Documents page: each Git repository, website or server folder
// the collection follows, its last sync (when, how it ended, files added/changed/removed/failed,
// each failed file's error) and its next one, "Sync now" (followed as a retrieval job until it
// ends), "Remove", and a form to add one whose 4xx messages stand next to the field they name.
import { api, ApiError, enc, listOf, retrieval } from "./api";
import { clear, field, h, toast } from "./dom";
import { followJob, isSuccess, isTerminal, jobStatus, progressOf, type Follow, type JobState } from "./jobs";

export type SourceType = "git" | "web" | "folder";

export interface SyncCounts {
  added?: number;
  changed?: number;
  removed?: number;
  failed?: number;
  unchanged?: number;
}

/** A file a sync could not take (whichever of these names the service uses for it). */
export interface SyncError {
  path?: string;
  file?: string;
  filename?: string;
  url?: string;
  code?: string;
  message?: string;
  error?: string;
}

export interface LastSync {
  job_id?: string | null;
  status?: string | null;
  started_at?: number | string | null;
  finished_at?: number | string | null;
  counts?: SyncCounts | null;
  errors?: SyncError[] | null;
  /** Why the whole sync failed (the source could not be read). */
  error?: string | null;
  /** Git: the commit synced. */
  commit?: string | null;
}

export interface Source {
  id: string;
  type: SourceType | string;
  url: string;
  branch?: string | null;
  paths?: string[] | null;
  interval_minutes?: number | null;
  last_sync?: LastSync | null;
  next_sync_at?: number | string | null;
  /** The sync job queued or running now. */
  syncing_job?: string | null;
  /** Files of the source in the collection, and the documents they became. */
  files?: number;
  documents?: number;
}

const COUNT_NAMES: (keyof SyncCounts)[] = ["added", "changed", "removed", "failed"];
const ALL_COUNTS: (keyof SyncCounts)[] = [...COUNT_NAMES, "unchanged"];

const URL_HINTS: Record<SourceType, { placeholder: string; hint: string }> = {
  git: { placeholder: "https://github.com/acme/handbook.git", hint: "The repository to clone (HTTPS, or file:// under a folder the operator allowed)" },
  web: { placeholder: "https://docs.example.com/", hint: "The start page: pages on the same host are followed, robots.txt honoured" },
  folder: { placeholder: "/srv/docs", hint: "A folder on the server under one the operator allowed" },
};

/** A time the services send as epoch seconds (or milliseconds, or ISO text), as a Date. */
export function toDate(v: number | string | null | undefined): Date | null {
  if (v === null || v === undefined || v === "") return null;
  if (typeof v === "number") return Number.isFinite(v) ? new Date(v > 1e12 ? v : v * 1000) : null;
  const n = Number(v);
  if (Number.isFinite(n)) return toDate(n);
  const t = Date.parse(v);
  return Number.isNaN(t) ? null : new Date(t);
}

/** "in 5 min", "3 h ago": how far ``d`` is from ``now``. */
export function relative(d: Date, now: number = Date.now()): string {
  const s = Math.round((d.getTime() - now) / 1000);
  const a = Math.abs(s);
  const [n, unit] = a < 60 ? [a, "s"] : a < 3600 ? [Math.round(a / 60), "min"] : a < 86400 ? [Math.round(a / 3600), "h"] : [Math.round(a / 86400), "d"];
  if (a < 5) return "now";
  return s > 0 ? `in ${n} ${unit}` : `${n} ${unit} ago`;
}

/** A time as `<time>`: local date and time, and how long ago or ahead; "–" when there is none. */
export function timeEl(v: number | string | null | undefined, cls: string): HTMLElement {
  const d = toDate(v);
  if (!d) return h("span", { class: `${cls} muted` }, "–");
  return h("time", { class: cls, datetime: d.toISOString(), title: d.toLocaleString() }, `${d.toLocaleString()} (${relative(d)})`);
}

/** The counts of a sync: the source's ``last_sync.counts`` or a job's ``result``. */
export function countsOf(obj: unknown): SyncCounts | null {
  if (!obj || typeof obj !== "object") return null;
  const o = obj as Record<string, unknown>;
  const out: SyncCounts = {};
  let any = false;
  for (const k of ALL_COUNTS) {
    if (typeof o[k] === "number") {
      out[k] = o[k] as number;
      any = true;
    }
  }
  return any ? out : null;
}

/** ``items`` with ``sep`` between them. */
function joined(items: (Node | string)[], sep: string): (Node | string)[] {
  return items.flatMap((el, i) => (i ? [sep, el] : [el]));
}

function countsView(counts: SyncCounts): HTMLElement {
  return h(
    "span",
    { class: "sync-counts" },
    joined(
      [...COUNT_NAMES, ...(counts.unchanged ? (["unchanged"] as const) : [])].map((k) =>
        h("span", { class: `count-${k}`, "data-count": k }, `${k} ${counts[k] ?? 0}`),
      ),
      ", ",
    ),
  );
}

function errorLine(e: SyncError | string): HTMLElement {
  if (typeof e === "string") return h("li", null, e);
  const what = e.path ?? e.file ?? e.filename ?? e.url ?? "";
  const why = e.message ?? e.error ?? e.code ?? "";
  return h("li", null, what ? h("code", null, what) : null, what && why ? ": " : "", why);
}

/** Each failed file with its reason, folded under "N errors" (open when there are few). */
function errorsView(errors: (SyncError | string)[]): HTMLElement | null {
  if (!errors.length) return null;
  return h(
    "details",
    { class: "sync-errors", open: errors.length <= 3 },
    h("summary", null, errors.length === 1 ? "1 file failed" : `${errors.length} files failed`),
    h("ul", null, errors.map(errorLine)),
  );
}

/** A job's per-file errors, wherever the service put them. */
function jobErrors(job: JobState): (SyncError | string)[] {
  const result = (job.result ?? {}) as Record<string, unknown>;
  for (const list of [result.errors, job.file_errors, job.errors]) {
    if (Array.isArray(list) && list.length) return list as (SyncError | string)[];
  }
  return [];
}

function statusBadge(status: string): HTMLElement {
  return h("span", { class: `badge ${status}`, "data-status": status }, status);
}

/** The form's fields by the name a 4xx ``param`` gives ("body.paths.0" is "paths"). */
export function fieldOfParam(param: string | null, names: string[]): string | null {
  if (!param) return null;
  const parts = param.split(".").filter((p) => p !== "body" && !/^\d+$/.test(p));
  return parts.find((p) => names.includes(p)) ?? null;
}

export interface SourcesPanel {
  el: HTMLElement;
  show: (collection: string | null) => void;
  dispose: () => void;
}

/** ``onSynced``: called with the collection after a sync it started ends (its documents changed). */
export function sourcesPanel(onSynced: (collection: string) => void = () => {}): SourcesPanel {
  let coll: string | null = null;
  // Each view of a collection's sources; answers for an older one are dropped.
  let generation = 0;
  const follows = new Map<string, Follow>();
  // How each source's followed sync goes or went (kept across redraws of the list).
  const outcome = new Map<string, HTMLElement>();
  // Sync jobs seen to end: a source still naming one as running is not followed again.
  const ended = new Set<string>();

  const list = h("ul", { class: "sources", id: "sources", "aria-label": "Sources", "aria-live": "polite" });

  // --- add a source -------------------------------------------------------------------
  const type = h(
    "select",
    { id: "source-type", name: "type" },
    h("option", { value: "git" }, "Git repository"),
    h("option", { value: "web" }, "Website"),
    h("option", { value: "folder" }, "Folder on the server"),
  );
  const url = h("input", { id: "source-url", name: "url", type: "text", required: true, autocomplete: "off", spellcheck: "false" });
  const branch = h("input", { id: "source-branch", name: "branch", type: "text", autocomplete: "off", placeholder: "main" });
  const paths = h("textarea", { id: "source-paths", name: "paths", rows: 2, placeholder: "docs/**/*.md", spellcheck: "false" });
  const interval = h("input", { id: "source-interval", name: "interval_minutes", type: "number", min: "0", step: "1", placeholder: "60" });
  const inputs: Record<string, HTMLInputElement | HTMLSelectElement | HTMLTextAreaElement> = {
    type,
    url,
    branch,
    paths,
    interval_minutes: interval,
  };
  const fieldErrors: Record<string, HTMLElement> = {};
  const fields: Record<string, HTMLElement> = {};
  const hints: Record<string, string> = {
    type: "",
    url: URL_HINTS.git.hint,
    branch: "Git only; the repository's default branch when empty",
    paths: "Globs, one per line (or comma-separated); every file when empty",
    interval_minutes: "Minutes between syncs: 60 when empty, 0 for on demand only",
  };
  const labels: Record<string, string> = { type: "Type", url: "URL", branch: "Branch", paths: "Paths", interval_minutes: "Interval (minutes)" };
  for (const [name, control] of Object.entries(inputs)) {
    const err = h("p", { class: "error field-error", role: "alert", id: `source-${name.replace("_minutes", "")}-error`, "data-field": name });
    fieldErrors[name] = err;
    const f = field(labels[name], control, hints[name] || undefined);
    f.append(err);
    fields[name] = f;
  }
  const formErr = h("p", { class: "error", role: "alert", id: "source-error" });
  const addBtn = h("button", { type: "submit", class: "primary", id: "source-add" }, "Add source");
  const form = h(
    "form",
    { class: "source-form", "aria-labelledby": "source-add-title" },
    h("h3", { id: "source-add-title" }, "Add a source"),
    h("div", { class: "grid source-grid" }, fields.type, fields.url, fields.paths, fields.branch, fields.interval_minutes),
    formErr,
    addBtn,
  );

  const syncType = () => {
    const t = type.value as SourceType;
    url.placeholder = URL_HINTS[t].placeholder;
    const hint = fields.url.querySelector(".hint");
    if (hint) hint.textContent = URL_HINTS[t].hint;
    fields.branch.hidden = t !== "git";
  };
  type.addEventListener("change", syncType);
  syncType();

  function clearErrors(): void {
    formErr.textContent = "";
    for (const [name, el] of Object.entries(fieldErrors)) {
      el.textContent = "";
      inputs[name].removeAttribute("aria-invalid");
    }
  }

  function bodyOfForm(): Record<string, unknown> {
    const t = type.value as SourceType;
    const body: Record<string, unknown> = { type: t, url: url.value.trim() };
    if (t === "git" && branch.value.trim()) body.branch = branch.value.trim();
    const globs = paths.value
      .split(/[\n,]/)
      .map((p) => p.trim())
      .filter(Boolean);
    if (globs.length) body.paths = globs;
    if (interval.value.trim()) body.interval_minutes = Number(interval.value);
    return body;
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const c = coll;
    if (!c) return;
    clearErrors();
    addBtn.disabled = true;
    try {
      const made = await api<Source>(retrieval(`/collections/${enc(c)}/sources`), { json: bodyOfForm() });
      if (c !== coll) return;
      toast(`Source ${made?.url ?? url.value} added to “${c}”.`);
      form.reset();
      syncType();
      await load();
    } catch (exc) {
      if (c !== coll) return;
      const name = exc instanceof ApiError ? fieldOfParam(exc.param, Object.keys(inputs)) : null;
      if (name) {
        fieldErrors[name].textContent = (exc as Error).message;
        inputs[name].setAttribute("aria-invalid", "true");
        inputs[name].setAttribute("aria-errormessage", fieldErrors[name].id);
        inputs[name].focus();
      } else {
        formErr.textContent = (exc as Error).message;
      }
    } finally {
      addBtn.disabled = false;
    }
  });

  // --- the list ----------------------------------------------------------------------------
  function lastSyncView(s: Source): HTMLElement {
    const last = s.last_sync;
    if (!last || (!last.status && !last.finished_at && !last.job_id)) {
      return h("p", { class: "last-sync muted" }, "Last sync: never");
    }
    const status = String(last.status ?? "").toLowerCase();
    const counts = countsOf(last.counts);
    return h(
      "div",
      { class: "last-sync", "data-job": last.job_id ?? false },
      h(
        "p",
        null,
        "Last sync: ",
        timeEl(last.finished_at ?? last.started_at, "sync-time"),
        " ",
        status ? statusBadge(status) : null,
        counts ? [" · ", countsView(counts)] : null,
        last.commit ? [" · commit ", h("code", null, last.commit.slice(0, 12))] : null,
      ),
      last.error ? h("p", { class: "error" }, last.error) : null,
      errorsView(last.errors ?? []),
    );
  }

  function sourceItem(c: string, s: Source): HTMLElement {
    const state = h("div", { class: "sync-state", role: "status", "aria-live": "polite" });
    const box = outcome.get(s.id);
    // A followed sync that ended is the source's last sync now: shown there, not twice.
    const shownAsLast = box?.dataset.job && box.dataset.job === s.last_sync?.job_id && box.dataset.ended === "true";
    if (box && !shownAsLast) state.append(box);
    const syncBtn = h("button", { type: "button", class: "sync-now", "aria-label": `Sync now: ${s.url}` }, "Sync now");
    const removeBtn = h("button", { type: "button", class: "danger remove-source", "aria-label": `Remove ${s.url}` }, "Remove");
    syncBtn.disabled = follows.has(s.id);
    const plural = (n: number, one: string) => `${n} ${one}${n === 1 ? "" : "s"}`;
    const held = typeof s.files === "number" ? `${plural(s.files, "file")}, ${plural(s.documents ?? 0, "document")}` : "";
    const what = [
      s.branch ? h("span", { class: "source-branch" }, "branch ", h("code", null, s.branch)) : null,
      s.paths?.length ? h("span", { class: "source-paths" }, "paths ", joined(s.paths.map((p) => h("code", null, p)), ", ")) : null,
      h("span", { class: "source-interval" }, s.interval_minutes ? `every ${s.interval_minutes} min` : "on demand only"),
      held ? h("span", { class: "source-held" }, held) : null,
    ].filter(Boolean) as HTMLElement[];
    const item = h(
      "li",
      { class: "source card", "data-id": s.id, "data-type": s.type },
      h("div", { class: "source-head" }, h("span", { class: "tag source-type" }, s.type), " ", h("code", { class: "source-url" }, s.url)),
      h("p", { class: "source-what small" }, joined(what, " · ")),
      lastSyncView(s),
      h(
        "p",
        { class: "next-sync small" },
        "Next sync: ",
        s.interval_minutes && s.next_sync_at ? timeEl(s.next_sync_at, "next-time") : h("span", { class: "muted" }, "on demand"),
      ),
      state,
      h("div", { class: "row-buttons" }, syncBtn, removeBtn),
    );
    syncBtn.addEventListener("click", () => void syncNow(c, s, syncBtn, state));
    removeBtn.addEventListener("click", async () => {
      if (!confirm(`Stop following ${s.url}? The documents it gave leave the collection.`)) return;
      try {
        await api(retrieval(`/collections/${enc(c)}/sources/${enc(s.id)}`), { method: "DELETE" });
        follows.get(s.id)?.stop();
        follows.delete(s.id);
        outcome.delete(s.id);
        toast(`Source ${s.url} removed.`);
        if (c === coll) await load();
        onSynced(c);
      } catch (exc) {
        toast(`Remove failed: ${(exc as Error).message}`, "error");
      }
    });
    return item;
  }

  /** The box that says how the source's current (or last followed) sync goes; one node per
   * source, moved into each redraw of the list. */
  function outcomeBox(sourceId: string): HTMLElement {
    let box = outcome.get(sourceId);
    if (!box) {
      box = h("div", { class: "sync-outcome" });
      outcome.set(sourceId, box);
    }
    return box;
  }

  async function syncNow(c: string, s: Source, btn: HTMLButtonElement, state: HTMLElement): Promise<void> {
    btn.disabled = true;
    const box = outcomeBox(s.id);
    delete box.dataset.job;
    delete box.dataset.status;
    delete box.dataset.ended;
    box.replaceChildren(h("p", { class: "sync-job" }, "Sync: starting…"));
    if (box.parentElement !== state) state.replaceChildren(box);
    try {
      const resp = await api<{ job_id?: string }>(retrieval(`/collections/${enc(c)}/sources/${enc(s.id)}/sync`), { method: "POST" });
      if (!resp?.job_id) throw new ApiError("the service started no sync job", 0);
      follow(c, s.id, resp.job_id);
    } catch (exc) {
      box.replaceChildren(h("p", { class: "sync-job error" }, `Sync failed to start: ${(exc as Error).message}`));
      btn.disabled = false;
    }
  }

  /** Follow the sync job ``jobId`` of a source until it ends, then redraw the list. */
  function follow(c: string, sourceId: string, jobId: string): void {
    follows.get(sourceId)?.stop();
    const box = outcomeBox(sourceId);
    const line = h("p", { class: "sync-job", "data-job": jobId }, "Sync: queued");
    box.dataset.job = jobId;
    delete box.dataset.ended;
    box.replaceChildren(line);
    const f = followJob(retrieval(`/jobs/${enc(jobId)}`), retrieval(`/jobs/${enc(jobId)}/events`), (job: JobState) => {
      const status = jobStatus(job) || "queued";
      box.dataset.status = status;
      if (!isTerminal(job)) {
        const p = progressOf(job);
        line.replaceChildren(`Sync: ${status}`, p ? ` · ${p.done}/${p.total}` : "");
        return;
      }
      f.stop();
      if (follows.get(sourceId) === f) follows.delete(sourceId);
      ended.add(jobId);
      box.dataset.ended = "true";
      const counts = countsOf(job.result);
      const why = typeof job.error === "string" ? job.error : String((job.error as Record<string, unknown>)?.message ?? "");
      line.className = isSuccess(job) ? "sync-job done" : "sync-job failed";
      line.replaceChildren(
        isSuccess(job) ? "Synced: " : `Sync ${status}${why ? `: ${why}` : ""}`,
        ...(counts ? [isSuccess(job) ? "" : " · ", countsView(counts)] : []),
      );
      const errs = errorsView(jobErrors(job));
      if (errs) box.append(errs);
      // The source's own view now holds this sync as its last one.
      if (c === coll) void load();
      onSynced(c);
    });
    follows.set(sourceId, f);
  }

  async function load(): Promise<void> {
    const c = coll;
    if (!c) return;
    const mine = ++generation;
    let items: Source[];
    try {
      items = listOf<Source>(await api(retrieval(`/collections/${enc(c)}/sources`)), "sources");
    } catch (exc) {
      if (mine !== generation) return;
      clear(list);
      const msg = exc instanceof ApiError && exc.status === 404 && !exc.param ? "This service does not follow sources." : (exc as Error).message;
      list.append(h("li", { class: "error" }, msg));
      return;
    }
    if (mine !== generation || c !== coll) return;
    // A sync started elsewhere (the schedule, another tab) is followed too.
    for (const s of items) {
      if (s.syncing_job && !follows.has(s.id) && !ended.has(s.syncing_job)) follow(c, s.id, s.syncing_job);
    }
    clear(list);
    if (!items.length) list.append(h("li", { class: "muted empty" }, "No sources: this collection holds only what is uploaded."));
    for (const s of items) list.append(sourceItem(c, s));
  }

  const refresh = h("button", { type: "button", class: "link", id: "sources-refresh" }, "Refresh");
  refresh.addEventListener("click", () => void load());
  const el = h(
    "section",
    { class: "sources-panel", "aria-labelledby": "sources-title" },
    h("div", { class: "panel-head" }, h("h2", { id: "sources-title" }, "Sources"), refresh),
    h("p", { class: "muted small" }, "Git repositories, websites and server folders this collection follows: changed files are re-read on each sync, deleted ones leave the collection."),
    list,
    form,
  );

  function stopAll(): void {
    for (const f of follows.values()) f.stop();
    follows.clear();
    outcome.clear();
    ended.clear();
  }

  return {
    el,
    show(name: string | null) {
      if (name === coll) return;
      stopAll();
      coll = name;
      generation++;
      clear(list);
      form.reset();
      syncType();
      clearErrors();
      if (name) void load();
    },
    dispose: stopAll,
  };
}
