// Feedback: what the tenant said about answers (thumbs, corrections, comments), counts per
// model, and "Train on feedback": the agent builds a dataset from it and starts a LoRA job on
// the model that wrote the answers; the job is followed here until its adapter is published.
import { api, ApiError, enc, listOf, trainer } from "../api";
import { clear, field, h, toast } from "../dom";
import { followJob, isSuccess, isTerminal, jobStatus, type Follow, type JobState } from "../jobs";
import { thumbIcon } from "../icons";
import { evalMetricsView, lossChartUpdater } from "../jobview";

export interface Feedback {
  message_id: string;
  rating: number;
  correction?: string | null;
  comment?: string | null;
  pipeline?: string | null;
  model?: string | null;
  collection?: string | null;
  question?: string | null;
  answer?: string | null;
  created_at?: number | string | null;
  updated_at?: number | string | null;
}

interface ModelStats {
  model: string;
  up: number;
  down: number;
  corrections: number;
  preferences: number;
}

const PAGE = 20;
// The last "train on feedback" job, so that leaving the page and coming back keeps following it.
const LAST_JOB = "tandem.feedback.job";

function when(t: number | string | null | undefined): string {
  if (t === null || t === undefined || t === "") return "";
  // Seconds since the epoch (the agent's timestamps) or an ISO string.
  const d = typeof t === "number" ? new Date(t < 1e12 ? t * 1000 : t) : new Date(t);
  return Number.isNaN(d.getTime()) ? String(t) : d.toLocaleString();
}

export function feedbackPage(root: HTMLElement) {
  let offset = 0;
  let follow: Follow | null = null;
  let disposed = false;

  // --- counts per model -----------------------------------------------------------
  const statsBody = h("tbody");
  const statsCard = h(
    "section",
    { class: "card", "aria-labelledby": "fb-stats-title" },
    h("h2", { id: "fb-stats-title" }, "Counts per model"),
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { class: "stats-table" },
        h(
          "thead",
          null,
          h("tr", null, h("th", { scope: "col" }, "Model"), h("th", { scope: "col" }, "Up"), h("th", { scope: "col" }, "Down"), h("th", { scope: "col" }, "Corrections"), h("th", { scope: "col" }, "Preferences")),
        ),
        statsBody,
      ),
    ),
  );

  // --- train on feedback ------------------------------------------------------------
  const format = h(
    "select",
    { id: "train-format" },
    h("option", { value: "auto" }, "Auto: KTO, or DPO where corrections outnumber thumbs up"),
    h("option", { value: "kto" }, "KTO: good and bad answers, corrections as good"),
    h("option", { value: "dpo" }, "DPO: corrections and chosen drafts as pairs"),
    h("option", { value: "sft" }, "SFT: good answers and corrections"),
  );
  const trainModel = h("select", { id: "train-model" });
  const trainBtn = h("button", { type: "submit", class: "primary", id: "train-start" }, "Train on feedback");
  const trainErr = h("p", { class: "error", role: "alert", id: "train-error" });
  const run = h("div", { class: "train-run", hidden: true });
  const trainForm = h(
    "form",
    { class: "card", "aria-labelledby": "fb-train-title" },
    h("h2", { id: "fb-train-title" }, "Train on feedback"),
    h("p", { class: "muted small" }, "Builds a dataset from this feedback (a share of the answers you rated up or corrected is held out to test it) and fine-tunes (LoRA, default settings) the model that wrote the answers. The adapter is published and joins the chat page's model picker; it becomes the default for chat only if it answers the held-out questions and your recent ones at least as well as the model it would replace (Training page: Model for chat)."),
    h("div", { class: "grid" }, field("Format", format), field("Model", trainModel)),
    trainErr,
    trainBtn,
    run,
  );

  // --- the list -----------------------------------------------------------------------
  const modelFilter = h("select", { id: "fb-filter-model" }, h("option", { value: "" }, "All models"));
  const ratingFilter = h(
    "select",
    { id: "fb-filter-rating" },
    h("option", { value: "" }, "All ratings"),
    h("option", { value: "1" }, "Good (thumbs up)"),
    h("option", { value: "-1" }, "Bad (thumbs down)"),
  );
  const list = h("ul", { class: "fb-list", "aria-label": "Feedback" });
  const pageInfo = h("span", { class: "small muted", id: "fb-page-info", role: "status" });
  const prev = h("button", { type: "button", id: "fb-prev" }, "Previous");
  const next = h("button", { type: "button", id: "fb-next" }, "Next");
  const listCard = h(
    "section",
    { class: "card", "aria-labelledby": "fb-list-title" },
    h("h2", { id: "fb-list-title", tabindex: "-1" }, "Feedback"),
    h("div", { class: "row", role: "group", "aria-label": "Filters" }, field("Model", modelFilter), field("Rating", ratingFilter)),
    list,
    h("div", { class: "pager" }, prev, pageInfo, next),
  );

  root.appendChild(
    h("div", { class: "page feedback" }, h("h1", null, "Feedback"), h("div", { class: "training-grid" }, h("div", { class: "col" }, statsCard, trainForm), listCard)),
  );

  async function loadStats(): Promise<void> {
    let stats: ModelStats[];
    try {
      stats = listOf<ModelStats>(await api("/v1/feedback/stats"), "stats");
    } catch (exc) {
      toast(`Feedback counts: ${(exc as Error).message}`, "error");
      return;
    }
    clear(statsBody);
    if (!stats.length) statsBody.appendChild(h("tr", null, h("td", { colspan: "5", class: "muted" }, "No feedback yet.")));
    for (const s of stats) {
      statsBody.appendChild(
        h("tr", { "data-model": s.model }, h("th", { scope: "row" }, s.model), h("td", { class: "up" }, s.up ?? 0), h("td", { class: "down" }, s.down ?? 0), h("td", { class: "corrections" }, s.corrections ?? 0), h("td", { class: "preferences" }, s.preferences ?? 0)),
      );
    }
    // The models with feedback are the filter's and the training's choices; the most talked-about first.
    const byCount = [...stats].sort((a, b) => total(b) - total(a)).map((s) => s.model);
    const keepFilter = modelFilter.value;
    clear(modelFilter);
    modelFilter.appendChild(h("option", { value: "" }, "All models"));
    for (const m of byCount) modelFilter.appendChild(h("option", { value: m }, m));
    modelFilter.value = byCount.includes(keepFilter) ? keepFilter : "";
    const keepTrain = trainModel.value;
    clear(trainModel);
    if (!byCount.length) trainModel.appendChild(h("option", { value: "" }, "(no feedback yet)"));
    for (const m of byCount) trainModel.appendChild(h("option", { value: m }, m));
    if (byCount.includes(keepTrain)) trainModel.value = keepTrain;
  }
  const total = (s: ModelStats) => (s.up ?? 0) + (s.down ?? 0) + (s.corrections ?? 0) + (s.preferences ?? 0);

  async function loadList(): Promise<void> {
    const q = new URLSearchParams({ limit: String(PAGE), offset: String(offset) });
    if (modelFilter.value) q.set("model", modelFilter.value);
    if (ratingFilter.value) q.set("rating", ratingFilter.value);
    let data: { data?: Feedback[]; total?: number; has_more?: boolean };
    try {
      data = await api(`/v1/feedback?${q}`);
    } catch (exc) {
      toast(`Feedback: ${(exc as Error).message}`, "error");
      return;
    }
    const items = listOf<Feedback>(data, "feedback");
    clear(list);
    if (!items.length) list.appendChild(h("li", { class: "muted empty" }, offset ? "No more feedback." : "No feedback matches."));
    for (const f of items) list.appendChild(item(f));
    const count = typeof data.total === "number" ? data.total : offset + items.length;
    pageInfo.textContent = items.length ? `${offset + 1}–${offset + items.length} of ${count}` : `0 of ${count}`;
    prev.disabled = offset === 0;
    next.disabled = !(data.has_more ?? offset + items.length < count);
  }

  function item(f: Feedback): HTMLElement {
    const good = f.rating === 1;
    const label = (f.question ?? "").trim().slice(0, 60) || f.message_id;
    const del = h("button", { type: "button", class: "icon danger", "aria-label": `Delete feedback on “${label}”`, title: "Delete" }, "✕");
    const li = h(
      "li",
      { class: `fb-item ${good ? "good" : "bad"}`, "data-id": f.message_id },
      h(
        "div",
        { class: "fb-head" },
        h("span", { class: "fb-rating", role: "img", "aria-label": good ? "Good answer" : "Bad answer" }, thumbIcon(good ? "up" : "down")),
        h("span", { class: "tag" }, f.model ?? "?"),
        f.pipeline ? h("span", { class: "tag" }, f.pipeline) : null,
        h("span", { class: "small muted" }, when(f.updated_at ?? f.created_at)),
        del,
      ),
      // Questions, answers, corrections and comments are the users' and the model's words: text only.
      f.question ? h("p", { class: "fb-question" }, h("strong", null, "Q: "), f.question) : null,
      f.answer ? h("p", { class: "fb-answer" }, h("strong", null, "A: "), f.answer) : null,
      f.correction ? h("p", { class: "fb-correction" }, h("strong", null, "Correction: "), f.correction) : null,
      f.comment ? h("p", { class: "fb-comment muted" }, h("strong", null, "Comment: "), f.comment) : null,
    );
    del.addEventListener("click", async () => {
      if (!confirm(`Delete this feedback (“${label}”)?`)) return;
      del.disabled = true;
      try {
        await api(`/v1/feedback/${enc(f.message_id)}`, { method: "DELETE" });
      } catch (exc) {
        toast(`Delete failed: ${(exc as Error).message}`, "error");
        del.disabled = false;
        return;
      }
      // Deleting the last item of a page shows the page before it.
      if (list.querySelectorAll(".fb-item").length === 1 && offset > 0) offset = Math.max(0, offset - PAGE);
      await Promise.all([loadList(), loadStats()]);
      listCard.querySelector<HTMLElement>("h2")?.focus();
    });
    return li;
  }

  modelFilter.addEventListener("change", () => {
    offset = 0;
    void loadList();
  });
  ratingFilter.addEventListener("change", () => {
    offset = 0;
    void loadList();
  });
  prev.addEventListener("click", () => {
    offset = Math.max(0, offset - PAGE);
    void loadList();
  });
  next.addEventListener("click", () => {
    offset += PAGE;
    void loadList();
  });

  // --- following the training job ------------------------------------------------------
  function followTraining(jobId: string, intro: string | null): void {
    follow?.stop();
    run.hidden = false;
    const status = h("p", { class: "job-status", role: "status", "aria-live": "polite", id: "train-status" });
    const bar = h("progress", { max: "1", value: "0", "aria-label": "Training progress" });
    const chart = h("div", { class: "chart", id: "train-chart" });
    const evalBox = h("div", { class: "eval-box", hidden: true });
    const result = h("div", { class: "train-result", id: "train-result" });
    run.replaceChildren(
      h("h3", null, "Job ", h("a", { href: `#/training/${enc(jobId)}` }, jobId)),
      h("p", { class: "small muted", id: "train-dataset", hidden: !intro }, intro ?? ""),
      status,
      bar,
      h("div", { class: "chart-row" }, chart, evalBox),
      result,
    );
    const refresh = lossChartUpdater(chart, jobId, () => !disposed);
    trainBtn.disabled = true;
    follow = followJob(trainer(`/jobs/${enc(jobId)}`), trainer(`/jobs/${enc(jobId)}/events`), (job: JobState) => {
      const p = job.progress as { step?: number; total?: number } | undefined;
      status.textContent = `Status: ${jobStatus(job)}${p && p.total ? ` · step ${p.step ?? 0} of ${p.total}` : ""}`;
      status.dataset.status = jobStatus(job);
      if (p && p.total) {
        bar.max = p.total;
        bar.value = p.step ?? 0;
      }
      void refresh(String(job.type ?? "kto"));
      const ev = evalMetricsView(job.metrics as Record<string, unknown> | undefined);
      evalBox.hidden = !ev;
      evalBox.replaceChildren(...(ev ? [ev] : []));
      if (!isTerminal(job)) return;
      trainBtn.disabled = false;
      const name = typeof job.fine_tuned_model === "string" ? job.fine_tuned_model : "";
      if (isSuccess(job) && name) {
        result.replaceChildren(
          h(
            "p",
            { class: "success", role: "status" },
            "Published as ",
            h("code", { class: "adapter-name" }, name),
            ". It is now in the chat page's model picker: ",
            h("a", { href: "#/chat" }, "chat with it"),
            ". Whether it becomes the default for chat is decided by its evaluation: ",
            h("a", { href: "#/training" }, "Training, Model for chat"),
            ".",
          ),
        );
      } else if (isSuccess(job)) {
        result.replaceChildren(h("p", { class: "error", role: "alert" }, "The job finished but published no model."));
      } else {
        const why = typeof job.error === "string" && job.error ? job.error : `the job ended ${jobStatus(job)}`;
        result.replaceChildren(h("p", { class: "error", role: "alert" }, `Training failed: ${why}`));
      }
    });
  }

  trainForm.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    trainErr.textContent = "";
    const body: Record<string, unknown> = { format: format.value };
    if (trainModel.value) body.model = trainModel.value;
    trainBtn.disabled = true;
    try {
      const out = await api<{ dataset?: { file_id?: string; rows?: number; counts?: Record<string, number> }; job?: JobState }>("/v1/feedback/train", { json: body });
      const job = out.job ?? {};
      const jobId = String(job.id ?? "");
      if (!jobId) throw new ApiError("the agent started no job", 0);
      sessionStorage.setItem(LAST_JOB, jobId);
      const ds = out.dataset ?? {};
      const counts = Object.entries(ds.counts ?? {})
        .map(([k, v]) => `${v} ${k}`)
        .join(", ");
      const chosen = (out.dataset as { format?: string } | undefined)?.format ?? format.value;
      followTraining(jobId, `Dataset ${ds.file_id ?? "?"}: ${ds.rows ?? "?"} rows${counts ? ` (${counts})` : ""}, ${chosen.toUpperCase()}.`);
    } catch (exc) {
      // Too little feedback is a 400 whose message names the counts found and needed.
      trainErr.textContent = (exc as Error).message;
      trainBtn.disabled = false;
    }
  });

  void loadStats().then(() => loadList());
  const last = sessionStorage.getItem(LAST_JOB);
  if (last) followTraining(last, null);

  return {
    dispose() {
      disposed = true;
      follow?.stop();
    },
  };
}
