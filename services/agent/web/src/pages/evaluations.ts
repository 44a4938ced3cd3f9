// Evaluations: the tenant's question sets (create, upload JSON lines, mark as a regression set),
// runs of a set through a pipeline and model with their progress, a run's answers with the
// judge's verdicts, two runs side by side (changed questions first), and a set's totals over time.
import { api, authHeaders, enc, errorFromBody, listOf } from "../api";
import { drawChart } from "../chart";
import { clear, field, h, toast } from "../dom";
import { loadEvalSets, type EvalSetSummary } from "../evalpick";
import { loadCollections, loadModels } from "./chat";

interface Question {
  id: string;
  question: string;
  answers?: string[] | null;
  reference?: string | null;
  source?: string | null;
  answerable: boolean;
}
interface EvalSet extends Omit<EvalSetSummary, "questions"> {
  questions: Question[];
}
interface Totals {
  questions: number;
  errors: number;
  stated: number | null;
  right_source: number | null;
  right_page: number | null;
  not_found: number | null;
  false_not_found: number | null;
  grounded: number | null;
  judged_correct: number | null;
  p50_seconds: number | null;
}
interface Result {
  n: number;
  id: string;
  question: string;
  answerable: boolean;
  answer: string;
  answer_kind: string;
  citations: { index?: number; title?: string; document_id?: string; page?: number | null }[];
  stated: boolean | null;
  right_source: boolean | null;
  right_page: boolean | null;
  abstained: boolean;
  false_abstention: boolean | null;
  grounded: number | null;
  judge?: { model: string; verdict: string; reason: string } | null;
  latency_seconds: number;
  error?: string | null;
}
interface Run {
  id: string;
  set: string;
  pipeline: string;
  llm?: string | null;
  status: string;
  progress: { done: number; total: number };
  totals: Totals;
  created_at: number;
  finished_at?: number | null;
  error?: string | null;
  results?: Result[];
}
interface Difference {
  a: number | null;
  b: number | null;
  difference: number | null;
  se: number | null;
  enough: boolean;
  questions_needed: number | null;
}
interface Comparison {
  a: string;
  b: string;
  questions: number;
  fixed: { n: number; id: string; question: string; a: Result; b: Result }[];
  broken: { n: number; id: string; question: string; a: Result; b: Result }[];
  same: number;
  totals: Record<string, Difference>;
  enough: boolean;
  questions_needed: number | null;
}

const METRICS: [keyof Totals, string, boolean][] = [
  ["stated", "Answer stated", true],
  ["right_source", "Right source cited", true],
  ["right_page", "Right page or section", true],
  ["not_found", "Not found when unanswerable", true],
  ["false_not_found", "False not found", true],
  ["grounded", "Grounded", true],
  ["judged_correct", "Judge: correct", true],
  ["p50_seconds", "Answer time p50", false],
];
// Comparison rows the totals table leaves out.
const EXTRA_LABELS: Record<string, string> = { overlap: "Reference words held", similarity: "Similarity to reference" };
const TERMINAL = ["succeeded", "failed", "cancelled"];

/** A JSON lines body as it is (the agent names a malformed line in its 400). */
async function postJsonl(path: string, text: string): Promise<EvalSet> {
  const resp = await fetch(path, { method: "POST", headers: { ...authHeaders(), "Content-Type": "application/jsonl" }, body: text });
  const data: unknown = await resp.json().catch(() => null);
  if (!resp.ok) throw errorFromBody(resp.status, data, `${resp.status} from ${path}`);
  return data as EvalSet;
}

function fmt(v: number | null | undefined, share: boolean): string {
  if (v === null || v === undefined) return "–";
  return share ? `${Math.round(v * 100)}%` : `${v.toFixed(2)} s`;
}

function signed(v: number | null, share: boolean): string {
  if (v === null) return "–";
  const s = share ? `${(v * 100).toFixed(0)} pts` : `${v.toFixed(2)} s`;
  return v > 0 ? `+${s}` : s;
}

function verdict(ok: boolean | null, yes: string, no: string): HTMLElement | null {
  if (ok === null) return null;
  return h("span", { class: `tag verdict ${ok ? "ok" : "bad"}` }, ok ? yes : no);
}

function verdicts(r: Result): HTMLElement {
  if (r.error) return h("div", { class: "verdicts" }, h("span", { class: "tag verdict bad" }, `error: ${r.error}`));
  return h(
    "div",
    { class: "verdicts" },
    r.answerable ? verdict(r.stated, "stated", "not stated") : verdict(r.abstained, "not found: right", "answered: wrong"),
    verdict(r.right_source, "right source", "wrong source"),
    verdict(r.right_page, "right page", "wrong page"),
    r.false_abstention ? h("span", { class: "tag verdict bad" }, "false not found") : null,
    r.grounded === null ? null : h("span", { class: "tag" }, `grounded ${fmt(r.grounded, true)}`),
    r.judge ? h("span", { class: `tag verdict ${r.judge.verdict === "correct" ? "ok" : "bad"}`, title: r.judge.reason }, `judge: ${r.judge.verdict}`) : null,
    h("span", { class: "small muted" }, `${r.latency_seconds.toFixed(2)} s`),
  );
}

function answerBlock(r: Result, label: string): HTMLElement {
  return h(
    "div",
    { class: "eval-answer" },
    h("strong", null, label),
    h("p", { class: "answer-text" }, r.answer || (r.error ? "" : "(empty)")),
    r.citations.length ? h("p", { class: "small muted" }, r.citations.map((c) => `[${c.index ?? "?"}] ${c.title || c.document_id || ""}${c.page ? ` p. ${c.page}` : ""}`).join("  ")) : null,
    verdicts(r),
  );
}

export function evaluationsPage(root: HTMLElement, args: string[]) {
  let disposed = false;
  let current: EvalSet | null = null;
  let polling: number | undefined;

  const setList = h("ul", { class: "coll-list eval-sets", "aria-label": "Evaluation sets" });
  const newName = h("input", { type: "text", required: true, maxlength: "200" });
  const newCollection = h("select", { required: true });
  const newRegression = h("input", { type: "checkbox" });
  const createForm = h(
    "form",
    { class: "create-eval-set", "aria-label": "New evaluation set" },
    field("Name", newName),
    field("Collection", newCollection),
    h("label", { class: "check" }, newRegression, " Regression set"),
    h("button", { type: "submit", class: "primary" }, "Create set"),
  );
  const side = h("aside", { class: "sidebar" }, h("h2", null, "Sets"), setList, createForm);
  const content = h("section", { class: "panel eval-content", "aria-live": "polite" });
  root.appendChild(h("div", { class: "page evaluations" }, h("h1", null, "Evaluations"), h("div", { class: "two-col" }, side, content)));

  async function refreshSets(): Promise<void> {
    let sets: EvalSetSummary[];
    try {
      sets = await loadEvalSets();
    } catch (exc) {
      toast(`Evaluation sets: ${(exc as Error).message}`, "error");
      return;
    }
    if (disposed) return;
    clear(setList);
    if (!sets.length) setList.appendChild(h("li", { class: "muted empty" }, "No set yet."));
    for (const s of sets) {
      setList.appendChild(
        h(
          "li",
          { "data-id": s.id },
          h(
            "a",
            { href: `#/evaluations/${enc(s.id)}`, "aria-current": current?.id === s.id ? "page" : null },
            s.name,
            " ",
            h("span", { class: "count" }, String(s.questions)),
            s.regression ? h("span", { class: "tag" }, "regression") : null,
          ),
        ),
      );
    }
  }

  createForm.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      const s = await api<EvalSet>("/v1/evals/sets", {
        json: { name: newName.value.trim(), collection: newCollection.value, regression: newRegression.checked, questions: [] },
      });
      newName.value = "";
      location.hash = `#/evaluations/${enc(s.id)}`;
    } catch (exc) {
      toast(`Create set: ${(exc as Error).message}`, "error");
    }
  });

  async function showSet(id: string | undefined): Promise<void> {
    window.clearTimeout(polling);
    clear(content);
    current = null;
    if (!id) {
      content.appendChild(h("p", { class: "muted empty" }, "Choose a set, or create one and upload its questions (JSON lines)."));
      void refreshSets();
      return;
    }
    try {
      current = await api<EvalSet>(`/v1/evals/sets/${enc(id)}`);
    } catch (exc) {
      content.appendChild(h("p", { class: "error" }, (exc as Error).message));
      return;
    }
    if (disposed) return;
    void refreshSets();
    renderSet(current);
  }

  function renderSet(s: EvalSet): void {
    const regression = h("input", { type: "checkbox", checked: s.regression });
    regression.addEventListener("change", async () => {
      try {
        await api(`/v1/evals/sets/${enc(s.id)}`, { method: "PATCH", json: { regression: regression.checked } });
        void refreshSets();
      } catch (exc) {
        toast((exc as Error).message, "error");
      }
    });
    const del = h("button", { type: "button", class: "danger" }, "Delete set");
    del.addEventListener("click", async () => {
      if (!confirm(`Delete ${s.name} and its runs?`)) return;
      await api(`/v1/evals/sets/${enc(s.id)}`, { method: "DELETE" });
      location.hash = "#/evaluations";
    });

    // -- questions: upload JSON lines ------------------------------------------------------
    const file = h("input", { type: "file", accept: ".jsonl,.ndjson,.json,.txt,application/jsonl" });
    const replace = h("input", { type: "checkbox" });
    const uploadState = h("p", { class: "small upload-state", role: "status" });
    const upload = h("button", { type: "button" }, "Upload");
    upload.addEventListener("click", async () => {
      const f = file.files?.[0];
      if (!f) {
        file.focus();
        return;
      }
      uploadState.className = "small muted upload-state";
      uploadState.textContent = "Uploading…";
      try {
        const updated = await postJsonl(`/v1/evals/sets/${enc(s.id)}/questions${replace.checked ? "?replace=true" : ""}`, await f.text());
        uploadState.textContent = `${updated.questions.length} questions in the set.`;
        current = updated;
        renderQuestions(updated);
        void refreshSets();
      } catch (exc) {
        uploadState.className = "small error upload-state";
        uploadState.textContent = (exc as Error).message;
      }
    });
    const questions = h("ol", { class: "eval-questions small", "aria-label": "Questions" });
    const renderQuestions = (set: EvalSet) => {
      clear(questions);
      for (const q of set.questions.slice(0, 200)) {
        const expected = q.answerable ? (q.answers?.join(" / ") ?? q.reference ?? "") : "not answerable";
        questions.appendChild(h("li", null, q.question, h("span", { class: "muted" }, ` → ${expected}`)));
      }
      qCount.textContent = `${set.questions.length} questions`;
    };
    const qCount = h("span", { class: "muted small" });

    // -- runs ---------------------------------------------------------------------------------
    const pipeline = h("select", { "aria-label": "Pipeline" });
    const llm = h("select", null, h("option", { value: "" }, "Tenant default"));
    const judge = h("select", null, h("option", { value: "" }, "No judge model"));
    const runButton = h("button", { type: "button", class: "primary run-set" }, "Run");
    const progress = h("progress", { max: "1", value: "0", hidden: true, "aria-label": "Run progress" });
    const runState = h("span", { class: "small muted run-state", role: "status" });
    const runList = h("ul", { class: "fb-list eval-runs", "aria-label": "Runs" });
    const chart = h("div", { class: "chart eval-chart" });
    const detail = h("section", { class: "eval-detail", "aria-label": "Run details" });
    const compareButton = h("button", { type: "button", class: "compare-runs" }, "Compare the two checked runs");

    runButton.addEventListener("click", async () => {
      runButton.disabled = true;
      try {
        const body: Record<string, unknown> = { set: s.id, pipeline: pipeline.value };
        if (llm.value) body.llm = llm.value;
        if (judge.value) body.judge_model = judge.value;
        const run = await api<Run>("/v1/evals/runs", { json: body });
        follow(run.id);
      } catch (exc) {
        runState.textContent = `Run not started: ${(exc as Error).message}`;
        runButton.disabled = false;
      }
    });

    const follow = (runId: string) => {
      progress.hidden = false;
      const tick = async () => {
        let run: Run;
        try {
          run = await api<Run>(`/v1/evals/runs/${enc(runId)}`);
        } catch (exc) {
          runState.textContent = (exc as Error).message;
          runButton.disabled = false;
          return;
        }
        if (disposed || current?.id !== s.id) return;
        progress.value = run.progress.total ? run.progress.done / run.progress.total : 0;
        runState.textContent = `${run.status}: ${run.progress.done} of ${run.progress.total} questions`;
        if (TERMINAL.includes(run.status)) {
          runButton.disabled = false;
          progress.hidden = true;
          if (run.error) runState.textContent = `${run.status}: ${run.error}`;
          await loadRuns();
          showRun(run);
          return;
        }
        polling = window.setTimeout(() => void tick(), 500);
      };
      void tick();
    };

    const loadRuns = async () => {
      const runs = listOf<Run>(await api(`/v1/evals/runs?set=${enc(s.id)}`));
      if (disposed) return;
      clear(runList);
      if (!runs.length) runList.appendChild(h("li", { class: "muted empty" }, "No run yet."));
      for (const r of runs) {
        const check = h("input", { type: "checkbox", class: "pick-run", value: r.id, "aria-label": `Compare run of ${new Date(r.created_at * 1000).toLocaleString()}` });
        const open = h("button", { type: "button", class: "link open-run" }, `${new Date(r.created_at * 1000).toLocaleString()} · ${r.llm ?? "default model"} · ${r.pipeline}`);
        open.addEventListener("click", async () => showRun(await api<Run>(`/v1/evals/runs/${enc(r.id)}`)));
        runList.appendChild(
          h(
            "li",
            { class: "fb-item", "data-id": r.id },
            h("div", { class: "fb-head" }, check, open, h("span", { class: `badge ${r.status}` }, r.status)),
            h("p", { class: "small" }, `stated ${fmt(r.totals.stated, true)} · right source ${fmt(r.totals.right_source, true)} · false not found ${fmt(r.totals.false_not_found, true)} · p50 ${fmt(r.totals.p50_seconds, false)}`),
          ),
        );
      }
      // Oldest first: each finished run is a point of the set's figures over time.
      const done = runs.filter((r) => r.status === "succeeded").reverse();
      const series = (key: keyof Totals, name: string, color: string) => ({
        name,
        color,
        points: done.flatMap((r, i): [number, number][] => (r.totals[key] === null ? [] : [[i + 1, r.totals[key] as number]])),
      });
      drawChart(chart, `Totals of ${s.name} over its runs`, [series("stated", "stated", "#2563eb"), series("right_source", "right source", "#16a34a"), series("false_not_found", "false not found", "#dc2626")]);
    };

    compareButton.addEventListener("click", async () => {
      const picked = [...runList.querySelectorAll<HTMLInputElement>("input.pick-run:checked")].map((c) => c.value);
      if (picked.length !== 2) {
        toast("Check two runs to compare them.", "error");
        return;
      }
      // The list is newest first: the older run is "a", the newer "b".
      const [b, a] = picked;
      try {
        showComparison(await api<Comparison>(`/v1/evals/runs/${enc(a)}/compare/${enc(b)}`));
      } catch (exc) {
        toast((exc as Error).message, "error");
      }
    });

    const showRun = (run: Run) => {
      clear(detail);
      const results = run.results ?? [];
      // Wrong answers first: they are what a reader of a run looks for.
      const order = [...results].sort((x, y) => Number(isRight(x)) - Number(isRight(y)) || x.n - y.n);
      detail.append(
        h("h3", null, `Run ${new Date(run.created_at * 1000).toLocaleString()} (${run.llm ?? "default model"})`),
        totalsTable([["This run", run.totals]]),
        h("ul", { class: "fb-list eval-results", "aria-label": "Answers" }, ...order.map((r) => h("li", { class: `fb-item ${isRight(r) ? "" : "bad"}`, "data-id": r.id }, h("p", { class: "fb-question" }, h("strong", null, `${r.n}. `), r.question), answerBlock(r, "Answer")))),
      );
    };

    const showComparison = (c: Comparison) => {
      clear(detail);
      const rows = Object.entries(c.totals).map(([key, d]) => {
        const share = key !== "p50_seconds";
        return h(
          "tr",
          { "data-metric": key },
          h("th", { scope: "row" }, METRICS.find((m) => m[0] === key)?.[1] ?? EXTRA_LABELS[key] ?? key),
          h("td", null, fmt(d.a, share)),
          h("td", null, fmt(d.b, share)),
          h("td", { class: "diff" }, signed(d.difference, share)),
          h("td", { class: "se" }, d.se === null ? "–" : share ? `±${(d.se * 100).toFixed(0)} pts` : `±${d.se.toFixed(2)} s`),
          h("td", { class: "enough" }, d.enough ? "yes" : d.questions_needed ? `no: ~${d.questions_needed} questions needed` : "no"),
        );
      });
      const changed = (label: string, list: Comparison["fixed"], cls: string) =>
        h(
          "section",
          { class: `eval-changed ${cls}`, "aria-label": label },
          h("h4", null, `${label} (${list.length})`),
          ...list.map((q) => h("div", { class: "fb-item eval-pair", "data-id": q.id }, h("p", { class: "fb-question" }, h("strong", null, `${q.n}. `), q.question), h("div", { class: "drafts-grid" }, answerBlock(q.a, "Before"), answerBlock(q.b, "After")))),
        );
      detail.append(
        h("h3", null, "Two runs side by side"),
        h("p", { class: "small muted compare-summary" }, `${c.questions} questions in both: ${c.broken.length} broken, ${c.fixed.length} fixed, ${c.same} the same. ${c.enough ? "The difference in answers stated is beyond 2 standard errors." : `Too few questions to tell the difference in answers stated apart from chance${c.questions_needed ? ` (about ${c.questions_needed} needed)` : ""}.`}`),
        h("div", { class: "table-wrap" }, h("table", { class: "stats-table compare-table" }, h("thead", null, h("tr", null, ...["Metric", "Before", "After", "Difference", "SE", "Enough?"].map((x) => h("th", { scope: "col" }, x)))), h("tbody", null, ...rows))),
        changed("Broken", c.broken, "broken"),
        changed("Fixed", c.fixed, "fixed"),
      );
    };

    content.append(
      h("div", { class: "row" }, h("h2", null, s.name), h("span", { class: "muted" }, ` collection ${s.collection}`)),
      h("div", { class: "row" }, h("label", { class: "check" }, regression, " Regression set (a fine-tune must answer it at least as well)"), del),
      h("section", { class: "card", "aria-label": "Questions" }, h("h3", null, "Questions ", qCount), field("Questions file (JSON lines)", file, "One question per line, as `tandem eval rag --questions` reads it."), h("label", { class: "check" }, replace, " Replace the set's questions"), upload, uploadState, h("details", null, h("summary", null, "Show questions"), questions)),
      h("section", { class: "card", "aria-label": "Run the set" }, h("h3", null, "Run"), h("div", { class: "row" }, field("Pipeline", pipeline), field("Model", llm), field("Judge", judge)), h("div", { class: "row-buttons" }, runButton, progress, runState)),
      h("section", { class: "card", "aria-label": "Runs of this set" }, h("h3", null, "Runs"), chart, runList, compareButton),
      detail,
    );
    renderQuestions(s);
    void (async () => {
      try {
        const catalog = listOf<{ id: string; kind: string }>(await api("/v1/pipelines"));
        for (const p of catalog.filter((x) => x.kind === "pipeline:chat")) pipeline.appendChild(h("option", { value: p.id }, p.id));
        pipeline.value = catalog.some((x) => x.id === "chat-documents-generate") ? "chat-documents-generate" : pipeline.value;
        for (const m of await loadModels()) {
          llm.appendChild(h("option", { value: m.id }, m.id));
          judge.appendChild(h("option", { value: m.id }, m.id));
        }
      } catch (exc) {
        toast((exc as Error).message, "error");
      }
    })();
    void loadRuns().catch((exc) => toast((exc as Error).message, "error"));
  }

  function isRight(r: Result): boolean {
    if (r.error) return false;
    return r.answerable ? Boolean(r.stated) : r.abstained;
  }

  function totalsTable(cols: [string, Totals][]): HTMLElement {
    return h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { class: "stats-table totals-table" },
        h("thead", null, h("tr", null, h("th", { scope: "col" }, "Metric"), ...cols.map(([name]) => h("th", { scope: "col" }, name)))),
        h("tbody", null, ...METRICS.map(([key, label, share]) => h("tr", { "data-metric": key }, h("th", { scope: "row" }, label), ...cols.map(([, t]) => h("td", null, fmt(t[key] as number | null, share)))))),
      ),
    );
  }

  void loadCollections()
    .then((names) => {
      for (const n of names) newCollection.appendChild(h("option", { value: n }, n));
    })
    .catch(() => undefined);
  void showSet(args[0]);
  return {
    dispose() {
      disposed = true;
      window.clearTimeout(polling);
    },
    onRoute(next: string[]) {
      void showSet(next[0]);
      return true;
    },
  };
}
