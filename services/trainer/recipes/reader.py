"""Reader jobs: fine-tune a cross-encoder that scores whether a sentence answers a question.

The model is a sentence-transformers ``CrossEncoder`` with one output logit, built from the
job's base: a bi-encoder folder (the default all-MiniLM-L6-v2) or a plain BERT-like folder gets
a new classification head, a published reader goes on training its own. Each row is a pair
``(question, reader_passage(sentence, context))`` (``services/common/readers.py``: the text the
inference service scores too) with label 1 (the sentence answers) or 0, and the loss is binary
cross-entropy on the logit. The step loop is the trainer's (``base.run``), so a reader job
checkpoints, resumes at the exact step, cancels and reports like every other job.

Batches are a pure function of the seed: each epoch a seeded shuffle of the rows, cut into
``batch_size`` pieces.

Held-out evaluation (before the first step and after the last) scores every held-out row with
the reader's probability (the sigmoid of its logit, as ``/v1/rerank`` answers) and reports:

- ``auc``: the chance that an answering sentence outscores a non-answering one (ties count half);
- ``mrr``: over the held-out questions with an answering candidate, the mean of 1 / the rank of
  their best-ranked answering sentence among all their candidates (ties ranked against it);
- ``f1`` and ``threshold``: the best F1 between answering and non-answering sentences over the
  cuts of the scores, and that cut (a sentence answers when its score is at or above it), which
  the published reader's manifest keeps;
- ``accuracy``: rows the threshold puts on their label's side, as the answer step would decide
  them (0.5 without a threshold). The threshold is chosen on these same rows, so F1 and accuracy
  are a little optimistic; AUC and MRR need no threshold. (Sentences that answer are usually a
  few among many candidates, so BCE keeps most probabilities under 0.5: a cut at 0.5 would call
  almost nothing an answer.)
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from services.common.readers import reader_passage
from services.trainer.data.formats import ReaderRecord, of_kind
from services.trainer.modeling import count_params
from services.trainer.recipes.base import Recipe, seed_everything

DEFAULT_MAX_LENGTH = 160  # tokens of a question and one sentence under its heading path
EVAL_BATCH = 64


def batch_schedule(rows: int, batch_size: int, epochs: int, seed: int) -> list[list[int]]:
    """Batches of row indices, every epoch reshuffled (seeded)."""
    out: list[list[int]] = []
    for epoch in range(epochs):
        order = list(range(rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out += [order[i : i + batch_size] for i in range(0, rows, batch_size)]
    return out


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (Mann-Whitney U, ties counted half); None without both labels."""
    pos, neg = int(labels.sum()), int(len(labels) - labels.sum())
    if not pos or not neg:
        return None
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # tied scores share their mean rank
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def mean_reciprocal_rank(scores: np.ndarray, labels: np.ndarray, questions: list[str]) -> float | None:
    """Over the questions with an answering candidate: 1 / the rank of the best-scored answering
    sentence among the question's candidates, a non-answering tie ranked ahead of it."""
    by_question: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_question.setdefault(q, []).append(i)
    reciprocal = []
    for idx in by_question.values():
        best = max((scores[i] for i in idx if labels[i] == 1), default=None)
        if best is not None:
            ahead = sum(1 for i in idx if labels[i] == 0 and scores[i] >= best)
            reciprocal.append(1.0 / (1 + ahead))
    return float(np.mean(reciprocal)) if reciprocal else None


def best_threshold(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float] | None:
    """(F1, threshold) of the cut that best separates answering sentences (score >= threshold)
    from the others; the threshold lies halfway to the next lower score, so a sentence scoring
    like the held-out ones lands on the same side. None without an answering sentence."""
    positives = int(labels.sum())
    if not positives:
        return None
    order = np.argsort(-scores, kind="mergesort")
    s, y = scores[order], labels[order]
    hits = np.cumsum(y)
    best: tuple[float, float] | None = None
    for k in range(len(s)):
        if k + 1 < len(s) and s[k + 1] == s[k]:
            continue  # a cut falls between distinct scores only
        f1 = 2 * hits[k] / (k + 1 + positives)
        if best is None or f1 > best[0]:
            threshold = (s[k] + s[k + 1]) / 2 if k + 1 < len(s) else s[k]
            best = (float(f1), float(threshold))
    return best


def reader_metrics(scores: np.ndarray, labels: np.ndarray, questions: list[str]) -> dict[str, float]:
    """The held-out figures of probabilities ``scores`` (see the module's docstring); a figure
    the rows cannot give (AUC with one label only) is left out."""
    out: dict[str, float] = {}
    for key, value in (
        ("auc", auc(scores, labels)),
        ("mrr", mean_reciprocal_rank(scores, labels, questions)),
    ):
        if value is not None:
            out[key] = value
    cut = best_threshold(scores, labels)
    if cut is not None:
        out["f1"], out["threshold"] = cut
    out["accuracy"] = float(np.mean((scores >= out.get("threshold", 0.5)) == (labels == 1)))
    return out


class ReaderRecipe(Recipe):
    def load_model(self, attn: str = "") -> None:
        from sentence_transformers import CrossEncoder

        seed_everything(self.hp.seed)  # a new classification head starts from the job's seed
        model = CrossEncoder(
            str(self.cfg.model_path),
            num_labels=1,
            max_length=self.hp.max_seq_length or DEFAULT_MAX_LENGTH,
            device=str(self.device),
        )
        model.train()
        self.model = model
        self.tokenizer = model.tokenizer
        trainable, total = count_params(model)
        self.hooks.log(
            f"reader {self.cfg.model_path.name}: {trainable:,} trainable of {total:,} parameters, "
            f"max_length {model.max_seq_length}"
        )

    def setup(self) -> None:
        self.load_model()
        self.rows = of_kind(self.cfg.records, ReaderRecord)
        self.held = of_kind(self.cfg.eval_records or [], ReaderRecord)
        self.schedule = batch_schedule(len(self.rows), self.hp.batch_size, self.hp.n_epochs, self.hp.seed)
        self.total_steps = min(len(self.schedule), self.hp.max_steps or len(self.schedule))
        self.make_optimizer()
        positives = sum(r.label for r in self.rows)
        self.hooks.log(
            f"{len(self.rows)} rows ({positives} answering), batches of {self.hp.batch_size}, "
            f"{self.total_steps} steps; held out: {len(self.held)} rows"
        )

    def _features(self, rows: list[ReaderRecord]) -> dict[str, torch.Tensor]:
        pairs = [(r.question, reader_passage(r.sentence, r.context)) for r in rows]
        feats = self.model.preprocess(pairs)
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in feats.items()}

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        rows = [self.rows[i] for i in self.schedule[step - 1]]
        features = self._features(rows)
        labels = torch.tensor([float(r.label) for r in rows], device=self.device)
        with self.autocast():
            logits = self.model(features)["scores"].view(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), labels)
        loss.backward()
        mask = features["attention_mask"]
        return self.finish_step(
            t0,
            float(loss.detach()),
            int(mask.sum()),
            int(mask.numel()),
            {"batch_size": float(len(rows)), "positives": float(labels.sum())},
        )

    def scores(self, rows: list[ReaderRecord]) -> np.ndarray:
        """The reader's probabilities for ``rows`` (the sigmoid of its logit)."""
        out = []
        for i in range(0, len(rows), EVAL_BATCH):
            with self.autocast():
                logits = self.model(self._features(rows[i : i + EVAL_BATCH]))["scores"].view(-1)
            out.append(torch.sigmoid(logits.float()).cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def evaluate(self) -> dict[str, float]:
        if not self.held:
            return {}
        labels = np.array([r.label for r in self.held])
        # a question's candidates are those of its own group (the same question over two
        # document sets has two candidate lists)
        questions = [f"{r.group}\x00{r.question}" for r in self.held]
        return reader_metrics(self.scores(self.held), labels, questions)

    def save_final(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.model.save(str(out))
        (out / "tandem_training.json").write_text(
            json.dumps(
                {
                    "type": self.cfg.kind,
                    "base_model": str(self.cfg.model_path),
                    "hyperparameters": self.hp.model_dump(),
                    "steps": self.total_steps,
                    "rows": len(self.rows),
                    "final_metrics": self.last_metrics,
                },
                indent=2,
            )
        )
