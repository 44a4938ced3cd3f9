// The model the tenant's chat answers with, and the promotion gate's verdicts on fine-tunes from
// feedback (GET /v1/promotions): shown on the training and quality pages, with promote, canary
// and roll back (POST /v1/models/{id}/promote | rollback).
import { api, enc } from "./api";
import { clear, h, toast } from "./dom";

interface ModelChoice {
  default: string | null;
  previous: string[];
  canary: string | null;
  canary_share: number;
}

interface GateScores {
  answered: number;
  matches: number | null;
  grounded: number | null;
  cited: number | null;
}

interface GateSet {
  name: string;
  questions: number;
  candidate: GateScores;
  current: GateScores;
  worse: string[];
}

interface Promotion {
  job_id: string;
  candidate: string | null;
  replaces: string;
  status: string;
  reason: string;
  sets: GateSet[];
  created_at: number;
}

interface LiveQuality {
  model: string;
  answers: number;
  groundedness_mean: number | null;
  cited_share: number;
  thumbs_up_rate: number | null;
}

interface PromotionList {
  choice: ModelChoice;
  live: LiveQuality[];
  data: Promotion[];
}

const STATUS: Record<string, string> = {
  training: "training",
  evaluating: "being evaluated",
  promoted: "promoted",
  kept: "kept as a candidate",
  failed: "failed",
};

function pct(v: number | null | undefined): string {
  return v === null || v === undefined ? "–" : `${Math.round(v * 100)}%`;
}

function gateTable(p: Promotion): HTMLElement {
  const rows = p.sets.flatMap((s) =>
    (["candidate", "current"] as const).map((side) =>
      h(
        "tr",
        { class: side === "candidate" && s.worse.length ? "worse" : "" },
        h("th", { scope: "row" }, `${s.name} (${s.questions})`),
        h("td", null, side === "candidate" ? p.candidate ?? "" : p.replaces || "base model"),
        h("td", null, pct(s[side].matches)),
        h("td", null, pct(s[side].grounded)),
        h("td", null, pct(s[side].cited)),
      ),
    ),
  );
  const head = ["Set", "Model", "Matches reference", "Grounded", "Cited"].map((c) => h("th", { scope: "col" }, c));
  return h("div", { class: "table-wrap" }, h("table", { class: "stats-table gate-table" }, h("thead", null, h("tr", null, ...head)), h("tbody", null, ...rows)));
}

/** A card with the tenant's chat model and the gate's verdicts; ``onChange`` runs after a promote or rollback. */
export function chatModelCard(onChange?: () => void): { el: HTMLElement; reload: () => Promise<void> } {
  const body = h("div", { id: "chat-model", "aria-live": "polite" });
  const el = h(
    "section",
    { class: "card chat-model", "aria-labelledby": "chat-model-title" },
    h("h2", { id: "chat-model-title" }, "Model for chat"),
    h("p", { class: "muted small" }, "A fine-tune from feedback is evaluated on your held-out rated answers and recent questions, and becomes the default for chat only if it answers at least as well as the model it would replace."),
    body,
  );

  async function act(model: string, action: "promote" | "rollback", share?: number): Promise<void> {
    try {
      await api(`/v1/models/${enc(model)}/${action}`, { method: "POST", json: share === undefined ? {} : { canary_share: share } });
      toast(action === "promote" ? (share !== undefined ? `${model} answers ${pct(share)} of chats` : `${model} is the default for chat`) : `${model} rolled back`);
      await reload();
      onChange?.();
    } catch (exc) {
      toast(`${action}: ${(exc as Error).message}`, "error");
    }
  }

  async function reload(): Promise<void> {
    let out: PromotionList;
    try {
      out = await api<PromotionList>("/v1/promotions");
    } catch (exc) {
      clear(body);
      body.append(h("p", { class: "error" }, (exc as Error).message));
      return;
    }
    const c = out.choice;
    clear(body);
    body.append(
      h(
        "p",
        { id: "chat-default" },
        "Default: ",
        h("code", null, c.default ?? "the base model"),
        c.default ? h("button", { type: "button", class: "small", id: "rollback-default", onclick: () => void act(c.default as string, "rollback") }, "Roll back") : null,
      ),
    );
    if (c.canary) {
      body.append(
        h(
          "p",
          { id: "chat-canary" },
          "Canary: ",
          h("code", null, c.canary),
          ` answers ${pct(c.canary_share)} of chats `,
          h("button", { type: "button", class: "small", onclick: () => void act(c.canary as string, "promote") }, "Promote"),
          h("button", { type: "button", class: "small", onclick: () => void act(c.canary as string, "rollback") }, "Stop"),
        ),
      );
      if (out.live.length) {
        body.append(
          h(
            "ul",
            { class: "small muted" },
            ...out.live.map((q) => h("li", null, `${q.model || "(no model)"}: ${q.answers} answers, grounded ${pct(q.groundedness_mean)}, cited ${pct(q.cited_share)}, thumbs up ${pct(q.thumbs_up_rate)}`)),
          ),
        );
      }
    }
    const list = h("ul", { class: "gate-list", "aria-label": "Fine-tunes from feedback" });
    for (const p of out.data) {
      const cand = p.candidate;
      const buttons =
        cand && p.status !== "failed" && cand !== c.default
          ? [
              h("button", { type: "button", class: "small", onclick: () => void act(cand, "promote") }, "Promote"),
              cand !== c.canary ? h("button", { type: "button", class: "small", onclick: () => void act(cand, "promote", 0.1) }, "Canary 10%") : null,
            ]
          : [];
      list.append(
        h(
          "li",
          { class: `gate-item ${p.status}`, "data-job": p.job_id },
          h("div", null, h("code", null, cand ?? p.job_id), " ", h("span", { class: "tag" }, STATUS[p.status] ?? p.status), ...buttons),
          p.reason ? h("p", { class: "small" }, p.reason) : null,
          p.sets.length ? gateTable(p) : null,
        ),
      );
    }
    if (out.data.length) body.append(list);
    else body.append(h("p", { class: "muted small" }, "No fine-tune from feedback yet (Feedback page: Train on feedback)."));
    // While a fine-tune trains or is evaluated, look again; a card no longer on the page stops.
    if (out.data.some((p) => p.status === "training" || p.status === "evaluating")) {
      setTimeout(() => {
        if (el.isConnected) void reload();
      }, 5000);
    }
  }

  void reload();
  return { el, reload };
}
