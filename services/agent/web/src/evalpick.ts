// "Add to evaluation": a chat answer (by its message id) becomes a question of one of the
// tenant's evaluation sets, its reference the corrected answer the user gives here.
import { api, enc, listOf } from "./api";
import { field, h } from "./dom";

export interface EvalSetSummary {
  id: string;
  name: string;
  collection: string;
  regression: boolean;
  questions: number;
}

export async function loadEvalSets(): Promise<EvalSetSummary[]> {
  return listOf<EvalSetSummary>(await api("/v1/evals/sets"));
}

/**
 * A button that opens a small form under `host`: the set, the reference answer (starting from
 * `reference()`: the correction, else the answer), then POST /v1/evals/sets/{id}/questions
 * {"from_message": {message_id, reference}}.
 */
export function addToEvaluation(messageId: string, reference: () => string, host: () => HTMLElement): HTMLElement {
  const button = h("button", { type: "button", class: "link add-eval" }, "Add to evaluation");
  button.addEventListener("click", async () => {
    const where = host();
    if (where.querySelector(".add-eval-form")) return;
    const pick = h("select", { class: "add-eval-set" });
    const box = h("textarea", { class: "add-eval-reference", rows: "4", maxlength: "20000" });
    box.value = reference();
    const save = h("button", { type: "submit", class: "primary" }, "Add");
    const cancel = h("button", { type: "button" }, "Cancel");
    const state = h("span", { class: "small muted add-eval-state", role: "status" });
    const form = h(
      "form",
      { class: "edit-form add-eval-form", "aria-label": "Add to an evaluation set" },
      field("Evaluation set", pick),
      field("Reference answer", box, "What a right answer says; the question is the one asked."),
      h("div", { class: "row-buttons" }, save, cancel, state),
    );
    cancel.addEventListener("click", () => {
      form.remove();
      button.focus();
    });
    where.appendChild(form);
    try {
      const sets = await loadEvalSets();
      for (const s of sets) pick.appendChild(h("option", { value: s.id }, `${s.name} (${s.collection}, ${s.questions})`));
      if (!sets.length) {
        state.textContent = "No evaluation set yet: create one on the Evaluations page.";
        save.disabled = true;
      }
    } catch (exc) {
      state.textContent = (exc as Error).message;
      state.className = "small error add-eval-state";
    }
    pick.focus();
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const text = box.value.trim();
      if (!pick.value || !text) {
        box.focus();
        return;
      }
      save.disabled = true;
      try {
        const set = await api<{ name: string; questions: unknown[] }>(`/v1/evals/sets/${enc(pick.value)}/questions`, {
          json: { from_message: { message_id: messageId, reference: text } },
        });
        form.replaceChildren(h("p", { class: "small success add-eval-done", role: "status" }, `Added to ${set.name} as question ${set.questions.length}.`));
      } catch (exc) {
        state.textContent = `Not added: ${(exc as Error).message}`;
        state.className = "small error add-eval-state";
        save.disabled = false;
      }
    });
  });
  return button;
}
