// Search: one collection, a query, a mode (hybrid, dense, sparse), optional metadata
// filters; results show the passages with the query's words highlighted.
import { api, enc, listOf, retrieval } from "../api";
import { clear, field, h, highlightTerms, toast } from "../dom";
import { loadCollections } from "./chat";

interface Result {
  chunk_id: string;
  document_id: string;
  text: string;
  score: number;
  scores?: Record<string, number>;
  metadata?: Record<string, unknown>;
  start?: number;
  end?: number;
  title?: string;
  highlights?: [number, number][];
  /** Where the passage is in its document (retrieval's structure fields). */
  section?: string;
  pages?: number[];
  anchor?: string | null;
}

type Op = "eq" | "ne" | "in" | "gt" | "gte" | "lt" | "lte";
const OPS: [Op, string][] = [
  ["eq", "="],
  ["ne", "≠"],
  ["in", "is one of"],
  ["gte", "≥"],
  ["lte", "≤"],
  ["gt", ">"],
  ["lt", "<"],
];

/** A typed value from a form field: numbers and booleans as such, else text. */
function typed(raw: string): unknown {
  const v = raw.trim();
  if (v === "true" || v === "false") return v === "true";
  if (v !== "" && !Number.isNaN(Number(v))) return Number(v);
  return v;
}

/**
 * The retrieval service's filter shape: a condition is {"field": {"$op": value}}
 * (equality may be a bare value), combined with {"$and": [...]} / {"$or": [...]}.
 */
export function buildFilter(rows: { key: string; op: Op; value: string }[], join: "and" | "or"): unknown {
  const conds = rows
    .filter((r) => r.key.trim())
    .map((r) => {
      const value = r.op === "in" ? r.value.split(",").map(typed) : typed(r.value);
      return { [r.key.trim()]: { [`$${r.op}`]: value } };
    });
  if (!conds.length) return undefined;
  if (conds.length === 1) return conds[0];
  return { [`$${join}`]: conds };
}

function passage(r: Result, terms: string[]): Node[] {
  if (r.highlights?.length) {
    // Server-side highlight ranges (character offsets within the chunk text).
    const out: Node[] = [];
    let last = 0;
    for (const [s, e] of [...r.highlights].sort((a, b) => a[0] - b[0])) {
      if (s < last) continue;
      out.push(document.createTextNode(r.text.slice(last, s)));
      out.push(h("mark", null, r.text.slice(s, e)));
      last = e;
    }
    out.push(document.createTextNode(r.text.slice(last)));
    return out;
  }
  return highlightTerms(r.text, terms);
}

const STOP = new Set(["the", "and", "for", "with", "what", "how", "who", "why", "does", "are", "was", "is", "of", "to", "in", "a", "an"]);

export function searchPage(root: HTMLElement) {
  const coll = h("select", { id: "search-collection", required: true });
  const query = h("input", { type: "search", id: "search-query", required: true, placeholder: "What are you looking for?" });
  const topK = h("input", { type: "number", id: "search-topk", min: "1", max: "100", value: "10" });
  const rerank = h("input", { type: "checkbox", id: "search-rerank" });
  const modes = h(
    "fieldset",
    { class: "modes" },
    h("legend", null, "Mode"),
    ...(["hybrid", "dense", "sparse"] as const).map((m) =>
      h("label", { class: "radio" }, h("input", { type: "radio", name: "mode", value: m, checked: m === "hybrid" }), ` ${m}`),
    ),
  );
  const filterRows = h("div", { class: "filter-rows" });
  const join = h("select", { id: "filter-join", "aria-label": "Combine filters with" }, h("option", { value: "and" }, "all of (and)"), h("option", { value: "or" }, "any of (or)"));
  const addFilter = h("button", { type: "button" }, "Add filter");
  const filters = h(
    "details",
    { class: "filters" },
    h("summary", null, "Metadata filters"),
    h("div", { class: "filter-join" }, h("label", { for: "filter-join" }, "Match "), join),
    filterRows,
    addFilter,
  );
  const submit = h("button", { type: "submit", class: "primary" }, "Search");
  const form = h(
    "form",
    { class: "search-form card", role: "search" },
    h("div", { class: "row" }, field("Collection", coll), field("Query", query), field("Results", topK)),
    h("div", { class: "row" }, modes, h("label", { class: "check" }, rerank, " rerank"), submit),
    filters,
  );
  const status = h("p", { class: "muted", role: "status" });
  const results = h("ol", { class: "results", "aria-label": "Search results" });
  root.appendChild(h("section", { class: "page search" }, h("h1", null, "Search"), form, status, results));

  function addRow(): void {
    const key = h("input", { type: "text", placeholder: "field, e.g. year", "aria-label": "Metadata field" });
    const op = h("select", { "aria-label": "Comparison" }, ...OPS.map(([v, l]) => h("option", { value: v }, l)));
    const value = h("input", { type: "text", placeholder: "value (a,b for “one of”)", "aria-label": "Value" });
    const remove = h("button", { type: "button", class: "icon", "aria-label": "Remove this filter" }, "✕");
    const row = h("div", { class: "filter-row" }, key, op, value, remove);
    remove.addEventListener("click", () => row.remove());
    filterRows.appendChild(row);
    key.focus();
  }
  addFilter.addEventListener("click", addRow);

  void loadCollections()
    .then((cols) => {
      for (const c of cols) coll.appendChild(h("option", { value: c }, c));
      const saved = sessionStorage.getItem("tandem.search.collection");
      if (saved && cols.includes(saved)) coll.value = saved;
    })
    .catch((exc) => toast(`Collections: ${(exc as Error).message}`, "error"));

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const q = query.value.trim();
    if (!q || !coll.value) return;
    sessionStorage.setItem("tandem.search.collection", coll.value);
    const mode = (form.querySelector<HTMLInputElement>('input[name="mode"]:checked')?.value ?? "hybrid") as string;
    const rows = Array.from(filterRows.querySelectorAll(".filter-row")).map((r) => {
      const [k, o, v] = r.querySelectorAll<HTMLInputElement | HTMLSelectElement>("input, select");
      return { key: k.value, op: o.value as Op, value: v.value };
    });
    const body: Record<string, unknown> = { query: q, mode, top_k: Number(topK.value) || 10 };
    const filter = buildFilter(rows, join.value as "and" | "or");
    if (filter) body.filters = filter;
    if (rerank.checked) body.rerank = true;
    submit.disabled = true;
    status.textContent = "Searching…";
    clear(results);
    const t0 = performance.now();
    try {
      const data = await api(retrieval(`/collections/${enc(coll.value)}/search`), { json: body });
      const found = listOf<Result>(data, "results");
      const ms = Math.round(performance.now() - t0);
      status.textContent = `${found.length} result${found.length === 1 ? "" : "s"} (${mode}, ${ms} ms)`;
      const terms = q.split(/\W+/).filter((w) => w.length > 2 && !STOP.has(w.toLowerCase()));
      for (const r of found) results.appendChild(resultItem(r, terms));
    } catch (exc) {
      status.textContent = "";
      results.appendChild(h("li", { class: "error", role: "alert" }, (exc as Error).message));
    } finally {
      submit.disabled = false;
    }
  });

  function resultItem(r: Result, terms: string[]): HTMLElement {
    const title = r.title || (r.metadata?.title as string) || r.document_id;
    const stages = Object.entries(r.scores ?? {})
      .map(([k, v]) => `${k} ${typeof v === "number" ? v.toFixed(3) : v}`)
      .join(" · ");
    const meta = Object.entries(r.metadata ?? {}).filter(([k]) => k !== "title");
    return h(
      "li",
      { class: "result card" },
      h("h2", null, title),
      r.section || r.pages?.length
        ? h(
            "p",
            { class: "small where" },
            [
              r.section ? `section ${r.section}` : "",
              r.pages?.length ? `${r.pages.length > 1 ? "pages" : "page"} ${r.pages.join(", ")}` : "",
              r.anchor ? `#${r.anchor}` : "",
            ]
              .filter(Boolean)
              .join(" · "),
          )
        : null,
      h(
        "p",
        { class: "muted small" },
        `score ${r.score?.toFixed?.(3) ?? r.score}`,
        stages ? ` (${stages})` : "",
        r.start !== undefined ? ` · characters ${r.start}–${r.end}` : "",
      ),
      h("blockquote", { class: "passage" }, ...passage(r, terms)),
      meta.length
        ? h("p", { class: "meta small" }, ...meta.map(([k, v]) => h("span", { class: "tag" }, `${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`)))
        : null,
    );
  }

  query.focus();
  return {};
}
