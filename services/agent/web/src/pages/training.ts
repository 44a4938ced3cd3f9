// Training: upload a dataset, start an SFT/DPO/KTO/SimPO/ORPO (or PPO/GRPO) job with sensible
// defaults, watch its status and loss (and reward) live with the held-out evaluation beside
// the chart, cancel it, and chat with the published result.
import { api, ApiError, enc, inference, listOf, sse, trainer, uploadWithProgress } from "../api";
import { clear, field, h, toast } from "../dom";
import { followJob, isTerminal, jobStatus, type Follow, type JobState } from "../jobs";
import { evalMetricsView, fmtNumber, lossChartUpdater, seriesFrom } from "../jobview";
import { renderMarkdown } from "../markdown";
import { chatModelCard } from "../promotions";

interface FileObject {
  id: string;
  filename: string;
  rows: number;
  format: string;
  kinds?: string[];
}

interface Job extends JobState {
  id: string;
  type: string;
  status: string;
  base_model: string;
  progress?: { step: number; total: number };
  metrics?: Record<string, number>;
  error?: string | null;
  fine_tuned_model?: string | null;
  published?: boolean;
  created_at?: number;
}

const DEFAULT_MODEL = "SmolLM2-135M-Instruct";
const DEFAULT_EMBEDDER = "all-MiniLM-L6-v2";

export { seriesFrom };

export function trainingPage(root: HTMLElement, args: string[]) {
  let selected: string | null = args[0] ?? null;
  let follow: Follow | null = null;
  let files: FileObject[] = [];

  // --- dataset upload -----------------------------------------------------------
  const picker = h("input", { type: "file", id: "dataset-file", accept: ".jsonl,.json" });
  const upProgress = h("progress", { max: "100", value: "0", hidden: true, "aria-label": "Dataset upload progress" });
  const upMsg = h("p", { role: "status", class: "small" });
  const uploadCard = h(
    "section",
    { class: "card", "aria-labelledby": "ds-title" },
    h("h2", { id: "ds-title" }, "1. Dataset"),
    h("p", { class: "muted small" }, "JSONL: SFT as messages, Alpaca, ShareGPT or prompt/completion; DPO as prompt/chosen/rejected; PPO/GRPO as prompts."),
    field("Dataset file", picker),
    upProgress,
    upMsg,
  );

  // --- job form ---------------------------------------------------------------
  const type = h(
    "select",
    { id: "job-type" },
    h("option", { value: "sft" }, "SFT (supervised fine-tuning)"),
    h("option", { value: "dpo" }, "DPO (preference pairs)"),
    h("option", { value: "kto" }, "KTO (answers labelled good or bad)"),
    h("option", { value: "simpo" }, "SimPO (preference pairs, no reference)"),
    h("option", { value: "orpo" }, "ORPO (preference pairs, no reference)"),
    h("option", { value: "grpo" }, "GRPO (reward, no critic)"),
    h("option", { value: "ppo" }, "PPO (reward, actor-critic)"),
    h("option", { value: "embedder" }, "Embedder (retrieval: query/passage pairs or a collection)"),
  );
  const baseModel = h("input", { type: "text", id: "job-base-model", value: DEFAULT_MODEL, list: "model-names", required: true });
  const modelNames = h("datalist", { id: "model-names" });
  const dataset = h("select", { id: "job-dataset", required: true }, h("option", { value: "" }, "(upload a dataset first)"));
  const maxSteps = h("input", { type: "number", id: "job-max-steps", min: "1", value: "20" });
  const epochs = h("input", { type: "number", id: "job-epochs", min: "1", max: "100", value: "1" });
  const lr = h("input", { type: "text", id: "job-lr", inputmode: "decimal", placeholder: "default (1e-4 with LoRA)" });
  const batch = h("input", { type: "number", id: "job-batch", min: "1", value: "4" });
  const useLora = h("input", { type: "checkbox", id: "job-lora", checked: true });
  const loraR = h("input", { type: "number", id: "job-lora-r", min: "1", value: "8" });
  const packing = h("input", { type: "checkbox", id: "job-packing", checked: true });
  const publish = h("input", { type: "checkbox", id: "job-publish", checked: true });
  const evalFraction = h("input", { type: "text", id: "job-eval-fraction", inputmode: "decimal", placeholder: "none (e.g. 0.1)" });
  const reward = h("input", { type: "text", id: "job-reward", placeholder: "e.g. gsm8k_exact_match" });
  // embedder jobs: a collection's titles and headings paired with their passages (no labels)
  const collection = h("input", { type: "text", id: "job-collection", placeholder: "none (e.g. docs)" });
  const rewardField = field("Reward function", reward, "A registered reward function name (PPO/GRPO only).");
  rewardField.hidden = true;
  const collectionField = field("Collection", collection, "Embedder jobs: one of your retrieval collections; its titles and headings train, paired with their passages (with or without a dataset).");
  collectionField.hidden = true;
  // embedder jobs with a collection and labelled pairs: train on what a query meets there
  const asChunks = h("input", { type: "checkbox", id: "job-chunks" });
  const titlePairs = h("input", { type: "checkbox", id: "job-title-pairs", checked: true });
  const chunkChecks = h(
    "div",
    { class: "checks", id: "job-chunk-checks", hidden: true },
    h("label", { class: "check", title: "Each labelled pair trains on its document's chunk nearest the query, with 3 hard negatives from the collection's own hybrid search (ranks 5 on)" }, asChunks, " labelled pairs as the collection's chunks, hard negatives from its search"),
    h("label", { class: "check" }, titlePairs, " also train on the collection's titles and headings"),
  );
  const formErr = h("p", { class: "error", role: "alert" });
  const start = h("button", { type: "submit", class: "primary", id: "job-start" }, "Start training");
  const jobForm = h(
    "form",
    { class: "card job-form", "aria-labelledby": "job-form-title" },
    h("h2", { id: "job-form-title" }, "2. Job"),
    h("div", { class: "grid" }, field("Type", type), field("Base model", baseModel), modelNames, field("Dataset", dataset), field("Epochs", epochs), field("Max steps", maxSteps), field("Learning rate", lr), field("Batch size", batch), field("LoRA rank", loraR), field("Held-out share", evalFraction)),
    rewardField,
    collectionField,
    chunkChecks,
    h("div", { class: "checks" }, h("label", { class: "check" }, useLora, " LoRA adapter"), h("label", { class: "check" }, packing, " zero-padding packing"), h("label", { class: "check" }, publish, " publish to the inference service when done")),
    formErr,
    start,
  );

  // --- jobs and the selected job ------------------------------------------------
  const jobsList = h("ul", { class: "job-list", "aria-label": "Training jobs" });
  const detail = h("section", { class: "card job-detail", "aria-labelledby": "job-title", hidden: true });
  const chatModel = chatModelCard();
  root.appendChild(
    h(
      "div",
      { class: "page training" },
      h("h1", null, "Training"),
      h("div", { class: "training-grid" }, h("div", { class: "col" }, chatModel.el, uploadCard, jobForm, h("section", { class: "card" }, h("h2", null, "Jobs"), jobsList)), detail),
    ),
  );

  type.addEventListener("change", () => {
    rewardField.hidden = !["ppo", "grpo"].includes(type.value);
    reward.required = !rewardField.hidden;
    const embedder = type.value === "embedder";
    collectionField.hidden = chunkChecks.hidden = !embedder;
    dataset.required = !embedder; // a collection alone will do
    // an embedder fine-tunes the whole encoder, unpacked; its base is a sentence-transformers model
    useLora.disabled = packing.disabled = embedder;
    if (embedder) useLora.checked = false;
    if (embedder && baseModel.value === DEFAULT_MODEL) baseModel.value = DEFAULT_EMBEDDER;
    if (!embedder && baseModel.value === DEFAULT_EMBEDDER) baseModel.value = DEFAULT_MODEL;
  });

  function fillDatasets(selectId?: string): void {
    clear(dataset);
    if (!files.length) dataset.appendChild(h("option", { value: "" }, "(upload a dataset first)"));
    for (const f of files) dataset.appendChild(h("option", { value: f.id }, `${f.filename} (${f.rows} rows, ${f.format})`));
    if (selectId) dataset.value = selectId;
  }

  async function loadFiles(): Promise<void> {
    try {
      const listed = listOf<FileObject>(await api(trainer("/files")), "files");
      // The listing may answer after an upload made meanwhile: keep that upload and the selection.
      const seen = new Set(listed.map((f) => f.id));
      files = [...files.filter((f) => !seen.has(f.id)), ...listed];
      fillDatasets(dataset.value || undefined);
    } catch {
      /* listing is optional: uploads made here still appear */
    }
  }

  picker.addEventListener("change", async () => {
    const file = picker.files?.[0];
    if (!file) return;
    const form = new FormData();
    form.append("file", file, file.name);
    upProgress.hidden = false;
    upProgress.value = 0;
    upMsg.className = "small";
    upMsg.textContent = `Uploading ${file.name}…`;
    try {
      const obj = (await uploadWithProgress(trainer("/files"), form, (f) => (upProgress.value = Math.round(f * 100)))) as FileObject;
      upProgress.value = 100;
      upMsg.textContent = `${obj.filename ?? file.name}: ${obj.rows ?? "?"} rows, format ${obj.format ?? "?"} (id ${obj.id}).`;
      files = [obj, ...files.filter((f) => f.id !== obj.id)];
      fillDatasets(obj.id);
      if (obj.kinds?.includes("dpo") && !obj.kinds.includes("sft")) type.value = "dpo";
      if (obj.kinds?.includes("kto") && !obj.kinds.includes("sft")) type.value = "kto";
      if (obj.kinds?.includes("embedder")) type.value = "embedder";
      type.dispatchEvent(new Event("change"));
    } catch (exc) {
      upProgress.hidden = true;
      upMsg.className = "small error";
      upMsg.textContent = `${file.name}: ${(exc as ApiError).message}`;
    }
  });

  jobForm.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    formErr.textContent = "";
    const embedderJob = type.value === "embedder";
    const fromCollection = embedderJob ? collection.value.trim() : "";
    if (!dataset.value && !fromCollection) {
      formErr.textContent = embedderJob ? "Upload pairs or name a collection first." : "Upload a dataset first.";
      picker.focus();
      return;
    }
    const hp: Record<string, unknown> = {};
    if (maxSteps.value) hp.max_steps = Number(maxSteps.value);
    if (epochs.value) hp.n_epochs = Number(epochs.value);
    if (batch.value) hp.batch_size = Number(batch.value);
    if (lr.value.trim()) {
      const v = Number(lr.value.trim());
      if (!Number.isFinite(v) || v <= 0) {
        formErr.textContent = `Learning rate ${JSON.stringify(lr.value)} is not a positive number.`;
        lr.focus();
        return;
      }
      hp.learning_rate = v;
    }
    let heldOut: number | null = null;
    if (evalFraction.value.trim()) {
      heldOut = Number(evalFraction.value.trim());
      if (!Number.isFinite(heldOut) || heldOut <= 0 || heldOut > 0.5) {
        formErr.textContent = `Held-out share ${JSON.stringify(evalFraction.value)} is not a number in (0, 0.5].`;
        evalFraction.focus();
        return;
      }
    }
    const body: Record<string, unknown> = {
      type: type.value,
      base_model: baseModel.value.trim(),
      publish: publish.checked,
      hyperparameters: hp,
    };
    if (dataset.value) body.dataset = dataset.value;
    if (fromCollection) {
      body.collection = fromCollection;
      if (asChunks.checked) {
        body.positives = "chunks";
        Object.assign(hp, { hard_negatives: 3, hard_negatives_from: "collection", hard_negatives_skip: 5 });
      }
      if (!titlePairs.checked) body.title_pairs = false;
    } else if (asChunks.checked) {
      formErr.textContent = "Name the collection whose chunks the pairs train on.";
      collection.focus();
      return;
    }
    if (!embedderJob) body.packing = packing.checked;
    if (useLora.checked && !embedderJob) body.lora = { r: Number(loraR.value) || 8, alpha: 2 * (Number(loraR.value) || 8) };
    if (heldOut !== null) body.eval_fraction = heldOut;
    if (["ppo", "grpo"].includes(type.value)) body.reward = reward.value.trim();
    start.disabled = true;
    try {
      const job = await api<Job>(trainer("/jobs"), { json: body });
      toast(`Job ${job.id} queued.`);
      location.hash = `#/training/${enc(job.id)}`;
      await loadJobs();
    } catch (exc) {
      formErr.textContent = (exc as Error).message;
    } finally {
      start.disabled = false;
    }
  });

  async function loadJobs(): Promise<void> {
    let jobs: Job[];
    try {
      jobs = listOf<Job>(await api(trainer("/jobs")), "jobs");
    } catch (exc) {
      toast(`Jobs: ${(exc as Error).message}`, "error");
      return;
    }
    jobs.sort((a, b) => (b.created_at ?? 0) - (a.created_at ?? 0));
    clear(jobsList);
    if (!jobs.length) jobsList.appendChild(h("li", { class: "muted empty" }, "No jobs yet."));
    for (const j of jobs) {
      jobsList.appendChild(
        h(
          "li",
          { "data-id": j.id },
          h(
            "a",
            { href: `#/training/${enc(j.id)}`, "aria-current": j.id === selected ? "page" : false },
            `${j.type.toUpperCase()} · ${j.base_model} `,
            h("span", { class: `badge ${j.status}` }, j.status),
          ),
        ),
      );
    }
  }

  // --- job detail -------------------------------------------------------------
  function showJob(id: string | null): void {
    follow?.stop();
    follow = null;
    selected = id;
    for (const a of jobsList.querySelectorAll("a")) {
      if (a.getAttribute("href") === `#/training/${enc(id ?? "")}`) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
    clear(detail);
    detail.hidden = !id;
    if (!id) return;
    const title = h("h2", { id: "job-title" }, `Job ${id}`);
    const status = h("p", { class: "job-status", role: "status", "aria-live": "polite" });
    const bar = h("progress", { max: "1", value: "0", "aria-label": "Training progress" });
    const metricsLine = h("p", { class: "small muted" });
    const chart = h("div", { class: "chart", id: "loss-chart" });
    const cancel = h("button", { type: "button", class: "danger", id: "job-cancel" }, "Cancel");
    const errorBox = h("p", { class: "error", role: "alert" });
    const chatBox = h("div", { class: "model-chat" });
    // The held-out evaluation (before -> after) sits beside the loss chart when the job has one.
    const evalBox = h("div", { class: "eval-box", id: "eval-metrics", hidden: true });
    detail.append(
      h("div", { class: "panel-head" }, title, cancel),
      status,
      bar,
      metricsLine,
      h("div", { class: "chart-row" }, chart, evalBox),
      errorBox,
      chatBox,
    );

    let lastType = "sft";
    let lastStatus = "";
    let chatShown = false;
    const refreshMetrics = lossChartUpdater(chart, id, () => selected === id);

    cancel.addEventListener("click", async () => {
      cancel.disabled = true;
      try {
        await api(trainer(`/jobs/${enc(id)}/cancel`), { method: "POST" });
        toast("Cancel requested; the job stops within a step.");
      } catch (exc) {
        toast(`Cancel failed: ${(exc as Error).message}`, "error");
        cancel.disabled = false;
      }
    });

    follow = followJob(trainer(`/jobs/${enc(id)}`), trainer(`/jobs/${enc(id)}/events`), (raw) => {
      const job = raw as Job;
      if (selected !== id) return;
      lastType = job.type ?? lastType;
      const p = job.progress;
      title.textContent = `${(job.type ?? "").toUpperCase()} job ${id}`;
      status.textContent = `Status: ${jobStatus(job)}${p && p.total ? ` · step ${p.step} of ${p.total}` : ""}`;
      status.dataset.status = jobStatus(job);
      if (p && p.total) {
        bar.max = p.total;
        bar.value = p.step;
      }
      const m = job.metrics ?? {};
      metricsLine.textContent = Object.entries(m)
        .filter(([k]) => !k.startsWith("eval_"))
        .slice(0, 8)
        .map(([k, v]) => `${k} ${typeof v === "number" ? fmtNumber(v) : v}`)
        .join(" · ");
      const ev = evalMetricsView(m);
      evalBox.hidden = !ev;
      evalBox.replaceChildren(...(ev ? [ev] : []));
      errorBox.textContent = job.error ?? "";
      cancel.disabled = isTerminal(job);
      void refreshMetrics(lastType);
      // Keep the jobs list's badges in step with what this view sees.
      if (jobStatus(job) !== lastStatus) {
        lastStatus = jobStatus(job);
        void loadJobs();
      }
      if (!chatShown && job.status === "succeeded" && job.fine_tuned_model && job.type === "embedder") {
        // an embedder is not chatted with: a collection switches to it
        chatShown = true;
        chatBox.append(
          h("p", { class: "small", id: "embedder-published" }, `Published as embedder ${job.fine_tuned_model}: switch a collection to it with PATCH /v1/collections/{name} {"embedder": "${job.fine_tuned_model}"}.`),
        );
      } else if (!chatShown && job.status === "succeeded" && job.fine_tuned_model) {
        chatShown = true;
        chatBox.append(modelChat(job.fine_tuned_model, Boolean(job.published)));
      }
    });
  }

  void loadFiles();
  void loadJobs();
  void api(inference("/models"))
    .then((d) => {
      for (const m of listOf<Record<string, string>>(d, "data")) modelNames.appendChild(h("option", { value: m.id }));
    })
    .catch(() => undefined);
  showJob(selected);

  return {
    onRoute(newArgs: string[]) {
      if ((newArgs[0] ?? null) !== selected) showJob(newArgs[0] ?? null);
      return true;
    },
    dispose() {
      follow?.stop();
    },
  };
}

/** A small chat with a model served by the inference service (OpenAI streaming over SSE). */
function modelChat(model: string, published: boolean): HTMLElement {
  const log = h("div", { class: "messages small-log", role: "log", "aria-live": "polite", "aria-label": `Chat with ${model}` });
  const input = h("input", { type: "text", id: "model-chat-input", placeholder: `Say something to ${model}…`, autocomplete: "off" });
  const send = h("button", { type: "submit", class: "primary" }, "Send");
  const form = h("form", { class: "composer inline" }, h("label", { for: "model-chat-input", class: "visually-hidden" }, "Message"), input, send);
  const history: { role: string; content: string }[] = [];
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const text = input.value.trim();
    if (!text) return;
    input.value = "";
    history.push({ role: "user", content: text });
    log.appendChild(h("article", { class: "msg user" }, h("p", null, text)));
    const body = h("div", { class: "md" });
    const answer = h("article", { class: "msg assistant", "aria-busy": "true" }, body);
    log.appendChild(answer);
    send.disabled = true;
    let out = "";
    try {
      for await (const e of sse(inference("/chat/completions"), {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ model, messages: history, stream: true, max_tokens: 200 }),
      })) {
        if (e.data === "[DONE]") break;
        const chunk = JSON.parse(e.data);
        out += chunk.choices?.[0]?.delta?.content ?? "";
        body.replaceChildren(renderMarkdown(out));
      }
      history.push({ role: "assistant", content: out });
    } catch (exc) {
      answer.appendChild(h("p", { class: "error", role: "alert" }, (exc as Error).message));
    } finally {
      answer.setAttribute("aria-busy", "false");
      send.disabled = false;
      input.focus();
    }
  });
  return h(
    "section",
    { "aria-labelledby": "model-chat-title" },
    h("h3", { id: "model-chat-title" }, `Chat with ${model}`),
    published ? null : h("p", { class: "muted small" }, "The job did not publish this model; it answers only if the inference service serves it."),
    log,
    form,
  );
}
