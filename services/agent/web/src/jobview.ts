// Pieces of a trainer job's view shared by the Training page and the Feedback page's
// "Train on feedback": the loss (and reward) chart fed from the job's metric history, and
// the held-out evaluation (before -> after) a job with `eval_fraction` reports.
import { api, enc, listOf, trainer } from "./api";
import { drawChart, type Series } from "./chart";
import { h } from "./dom";

/** Metric history in any of these shapes: [{step, loss, ...}], {data: [...]}, {loss: [[step, v], ...]}. */
export function seriesFrom(data: unknown, names: string[]): Record<string, [number, number][]> {
  const out: Record<string, [number, number][]> = Object.fromEntries(names.map((n) => [n, []]));
  const rows = listOf<Record<string, unknown>>(data, "metrics", "history");
  if (rows.length) {
    rows.forEach((row, i) => {
      const step = Number(row.step ?? i + 1);
      const vals = (row.metrics as Record<string, unknown>) ?? row;
      for (const n of names) {
        const v = Number(vals[n]);
        if (vals[n] !== undefined && vals[n] !== null && Number.isFinite(v)) out[n].push([step, v]);
      }
    });
    return out;
  }
  if (data && typeof data === "object") {
    for (const n of names) {
      const pts = (data as Record<string, unknown>)[n];
      if (Array.isArray(pts)) {
        out[n] = pts.map((p, i) => (Array.isArray(p) ? [Number(p[0]), Number(p[1])] : [i + 1, Number(p)]));
      }
    }
  }
  return out;
}

/**
 * A refresher for a job's loss chart: each call re-reads the metric history and redraws.
 * A call made while a read is in flight runs once more after it, so that the update that
 * ends the job always draws its last points. `isCurrent` lets a view that moved on to
 * another job ignore a late answer.
 */
export function lossChartUpdater(
  chart: HTMLElement,
  jobId: string,
  isCurrent: () => boolean = () => true,
): (jobType: string) => Promise<void> {
  let busy = false;
  let again: string | null = null;
  drawChart(chart, "Training loss", []);
  const refresh = async (jobType: string): Promise<void> => {
    if (busy) {
      again = jobType;
      return;
    }
    busy = true;
    try {
      const s = seriesFrom(await api(trainer(`/jobs/${enc(jobId)}/metrics`)), ["loss", "reward"]);
      const series: Series[] = [{ name: "loss", color: "#2563eb", points: s.loss }];
      if (["ppo", "grpo"].includes(jobType) || s.reward.length) series.push({ name: "reward", color: "#d97706", points: s.reward });
      if (isCurrent()) drawChart(chart, "Training loss" + (series.length > 1 ? " and reward" : ""), series);
    } catch {
      /* the next update retries */
    } finally {
      busy = false;
    }
    if (again !== null && isCurrent()) {
      const next = again;
      again = null;
      await refresh(next);
    }
  };
  return refresh;
}

export function fmtNumber(v: number): string {
  const a = Math.abs(v);
  return a !== 0 && (a < 0.01 || a > 1e4) ? v.toExponential(2) : v.toFixed(4);
}

/** The held-out metrics the trainer reports as `eval_<name>_before` / `eval_<name>_after`. */
const EVAL_ROWS: { key: string; label: string; better: "lower" | "higher"; percent?: boolean }[] = [
  { key: "loss", label: "Loss", better: "lower" },
  { key: "accuracy", label: "Accuracy", better: "higher", percent: true },
  { key: "margin", label: "Margin", better: "higher" },
  // embedder jobs: the held-out queries ranked against the corpus
  { key: "ndcg@10", label: "nDCG@10", better: "higher" },
  { key: "recall@100", label: "Recall@100", better: "higher", percent: true },
  { key: "recall@10", label: "Recall@10", better: "higher", percent: true },
  { key: "mrr@10", label: "MRR@10", better: "higher" },
];

export function hasEvalMetrics(metrics: Record<string, unknown> | undefined | null): boolean {
  if (!metrics) return false;
  return Object.keys(metrics).some((k) => /^eval_.+_(before|after)$/.test(k));
}

/**
 * A table of the job's held-out evaluation, before -> after training, each change marked
 * better or worse. Null when the job reports none (no `eval_fraction`).
 */
export function evalMetricsView(metrics: Record<string, unknown> | undefined | null): HTMLElement | null {
  if (!metrics || !hasEvalMetrics(metrics)) return null;
  const num = (k: string): number | null => {
    const v = metrics[k];
    return typeof v === "number" && Number.isFinite(v) ? v : null;
  };
  const rows: HTMLElement[] = [];
  for (const r of EVAL_ROWS) {
    const before = num(`eval_${r.key}_before`);
    const after = num(`eval_${r.key}_after`);
    if (before === null && after === null) continue;
    const show = (v: number | null) => (v === null ? "–" : r.percent ? `${(v * 100).toFixed(1)}%` : fmtNumber(v));
    let trend = "";
    if (before !== null && after !== null && before !== after) {
      const improved = r.better === "lower" ? after < before : after > before;
      trend = improved ? "better" : "worse";
    }
    rows.push(
      h(
        "tr",
        { "data-metric": r.key, class: trend },
        h("th", { scope: "row" }, r.label),
        h("td", { class: "before" }, show(before)),
        h("td", { class: "arrow", "aria-hidden": "true" }, "→"),
        h("td", { class: "after" }, show(after)),
        h("td", { class: "trend" }, trend),
      ),
    );
  }
  if (!rows.length) return null;
  return h(
    "section",
    { class: "eval-metrics", "aria-label": "Held-out evaluation" },
    h("h3", null, "Held-out evaluation"),
    h(
      "table",
      { class: "eval-table" },
      h(
        "thead",
        null,
        h("tr", null, h("th", { scope: "col" }, "Metric"), h("th", { scope: "col" }, "Before"), h("td", null), h("th", { scope: "col" }, "After"), h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Change"))),
      ),
      h("tbody", null, rows),
    ),
  );
}
