// Quality: how the tenant's chat answers fare on live traffic, per model over time (groundedness,
// cited, extractive and "not found" shares) beside the thumbs-up rate, and the worst recent
// answers (a thumbs down, or sentences no source supports), each one click from its conversation.
import { api, enc, listOf } from "../api";
import { clear, field, h, toast } from "../dom";
import { addToEvaluation } from "../evalpick";
import { thumbIcon } from "../icons";
import { chatModelCard } from "../promotions";

interface QualityPoint {
  model: string;
  start: number;
  answers: number;
  groundedness_mean: number | null;
  judged: number;
  cited_share: number;
  extractive_share: number;
  not_found_share: number;
  rated: number;
  thumbs_up_rate: number | null;
}

interface WorstAnswer {
  message_id: string;
  conversation_id?: string | null;
  pipeline: string;
  model: string;
  created_at: number;
  question: string;
  answer: string;
  groundedness: number | null;
  cited: boolean;
  answer_kind: string;
  rating: number | null;
}

const KIND_LABEL: Record<string, string> = { generated: "generated", extractive: "extractive", not_found: "not found" };

function pct(v: number | null | undefined): string {
  return v === null || v === undefined ? "–" : `${Math.round(v * 100)}%`;
}

function period(start: number, bucket: string): string {
  const d = new Date(start * 1000);
  if (bucket === "hour") return d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" });
  const day = d.toLocaleDateString(undefined, { dateStyle: "medium", timeZone: "UTC" });
  return bucket === "week" ? `week of ${day}` : day;
}

export function qualityPage(root: HTMLElement) {
  let disposed = false;
  const bucket = h(
    "select",
    { id: "q-bucket" },
    h("option", { value: "hour" }, "Hour"),
    h("option", { value: "day" }, "Day"),
    h("option", { value: "week" }, "Week"),
  );
  bucket.value = "day";
  const modelFilter = h("select", { id: "q-model" }, h("option", { value: "" }, "All models"));
  const tables = h("div", { class: "quality-models", id: "quality-models", "aria-live": "polite" });
  const overTime = h(
    "section",
    { class: "card", "aria-labelledby": "q-time-title" },
    h("h2", { id: "q-time-title" }, "Per model over time"),
    h(
      "p",
      { class: "muted small" },
      "Groundedness: the share of an answer's sentences a source supports (answers the guard judged). Cited: answers with a [n] marker. Extractive: the guard answered with source sentences. Not found: the documents do not say.",
    ),
    h("div", { class: "row", role: "group", "aria-label": "Report" }, field("Period", bucket), field("Model", modelFilter)),
    tables,
  );
  const worstList = h("ul", { class: "fb-list quality-worst", "aria-label": "Worst recent answers" });
  const worstCard = h(
    "section",
    { class: "card", "aria-labelledby": "q-worst-title" },
    h("h2", { id: "q-worst-title" }, "Worst recent answers"),
    h("p", { class: "muted small" }, "The last week's answers with a thumbs down first, then the least grounded."),
    worstList,
  );
  // after a promote or rollback the report's models change: reload it
  const chatModel = chatModelCard(() => void loadReport());
  root.appendChild(h("div", { class: "page quality" }, h("h1", null, "Quality"), chatModel.el, h("div", { class: "quality-grid" }, overTime, worstCard)));

  function table(model: string, points: QualityPoint[]): HTMLElement {
    const head = ["Period", "Answers", "Groundedness", "Cited", "Extractive", "Not found", "Thumbs up"];
    const body = h("tbody");
    // Newest first: the figure a reader looks for is this period's.
    for (const p of [...points].sort((a, b) => b.start - a.start)) {
      body.appendChild(
        h(
          "tr",
          { "data-start": String(p.start) },
          h("th", { scope: "row" }, period(p.start, bucket.value)),
          h("td", { class: "answers" }, p.answers),
          h("td", { class: "groundedness" }, pct(p.groundedness_mean)),
          h("td", { class: "cited" }, pct(p.cited_share)),
          h("td", { class: "extractive" }, pct(p.extractive_share)),
          h("td", { class: "not-found" }, pct(p.not_found_share)),
          h("td", { class: "thumbs-up" }, p.rated ? `${pct(p.thumbs_up_rate)} of ${p.rated}` : "–"),
        ),
      );
    }
    return h(
      "section",
      { class: "quality-model", "aria-label": `Quality of ${model || "no model"}`, "data-model": model },
      h("h3", null, h("code", null, model || "(no model)")),
      h(
        "div",
        { class: "table-wrap" },
        h("table", { class: "stats-table" }, h("thead", null, h("tr", null, ...head.map((c) => h("th", { scope: "col" }, c)))), body),
      ),
    );
  }

  async function loadReport(): Promise<void> {
    const q = new URLSearchParams({ bucket: bucket.value });
    if (modelFilter.value) q.set("model", modelFilter.value);
    let points: QualityPoint[];
    try {
      points = listOf<QualityPoint>(await api(`/v1/quality?${q}`));
    } catch (exc) {
      toast(`Quality: ${(exc as Error).message}`, "error");
      return;
    }
    if (disposed) return;
    const byModel = new Map<string, QualityPoint[]>();
    for (const p of points) byModel.set(p.model, [...(byModel.get(p.model) ?? []), p]);
    clear(tables);
    if (!byModel.size) tables.appendChild(h("p", { class: "muted empty" }, "No answers in this period yet."));
    for (const [model, ps] of byModel) tables.appendChild(table(model, ps));
    if (!modelFilter.value) {
      // The models answering lately are the filter's choices.
      clear(modelFilter);
      modelFilter.appendChild(h("option", { value: "" }, "All models"));
      for (const m of byModel.keys()) modelFilter.appendChild(h("option", { value: m }, m || "(no model)"));
    }
  }

  function turnDetails(w: WorstAnswer, label: string): HTMLElement {
    const body = h("div", { class: "q-turn" });
    const details = h("details", { class: "q-open" }, h("summary", null, label), body);
    details.addEventListener("toggle", async () => {
      if (!details.open || body.childElementCount) return;
      try {
        const rec = await api<{ answer?: string; citations?: { title?: string; index?: number }[] }>(`/v1/messages/${enc(w.message_id)}`);
        body.append(
          h("p", null, rec.answer ?? ""),
          h("ul", { class: "small muted" }, ...(rec.citations ?? []).map((c) => h("li", null, `[${c.index ?? "?"}] ${c.title ?? ""}`))),
        );
      } catch (exc) {
        body.append(h("p", { class: "error" }, (exc as Error).message));
      }
    });
    return details;
  }

  function worstItem(w: WorstAnswer): HTMLElement {
    const bad = w.rating === -1;
    const label = w.question.trim().slice(0, 80) || w.message_id;
    // A remembered turn opens in its conversation; one outside a conversation shows its record here.
    const open = w.conversation_id
      ? h("a", { href: `#/chat/${enc(w.conversation_id)}/${enc(w.message_id)}`, class: "q-open" }, label)
      : turnDetails(w, label);
    const item: HTMLLIElement = h(
      "li",
      { class: `fb-item ${bad ? "bad" : "weak"}`, "data-id": w.message_id },
      h(
        "div",
        { class: "fb-head" },
        bad ? h("span", { class: "fb-rating", role: "img", "aria-label": "Thumbs down" }, thumbIcon("down")) : null,
        h("span", { class: "tag" }, w.model || "?"),
        h("span", { class: "tag kind" }, KIND_LABEL[w.answer_kind] ?? w.answer_kind),
        h("span", { class: "tag groundedness" }, `grounded ${pct(w.groundedness)}`),
        w.cited ? null : h("span", { class: "tag" }, "no citation"),
        h("span", { class: "small muted" }, new Date(w.created_at * 1000).toLocaleString()),
      ),
      h("p", { class: "fb-question" }, h("strong", null, "Q: "), open),
      h("p", { class: "fb-answer" }, h("strong", null, "A: "), w.answer.length > 400 ? `${w.answer.slice(0, 400)}…` : w.answer),
      // the reference starts from the answer: the reader corrects it into what it should say
      h("div", { class: "fb-buttons" }, addToEvaluation(w.message_id, () => w.answer, (): HTMLElement => item)),
    );
    return item;
  }

  async function loadWorst(): Promise<void> {
    let items: WorstAnswer[];
    try {
      items = listOf<WorstAnswer>(await api("/v1/quality/worst?limit=10"));
    } catch (exc) {
      toast(`Worst answers: ${(exc as Error).message}`, "error");
      return;
    }
    if (disposed) return;
    clear(worstList);
    if (!items.length) worstList.appendChild(h("li", { class: "muted empty" }, "No weak answers this week."));
    for (const w of items) worstList.appendChild(worstItem(w));
  }

  bucket.addEventListener("change", () => void loadReport());
  modelFilter.addEventListener("change", () => void loadReport());
  void loadReport();
  void loadWorst();
  return {
    dispose() {
      disposed = true;
    },
  };
}
