"""Reader jobs with ``"reader_kind": "bi-encoder"``: a sentence encoder tuned to read.

The reader is a sentence-transformers bi-encoder (by default the collections' own
all-MiniLM-L6-v2): a sentence's score is the cosine of the question's vector and the vector of
``reader_passage(sentence, context)``, the text a cross-encoder reader reads too. Training sees
one question at a time with its candidate sentences (the rows sharing its ``group`` and
``question``): up to ``MAX_ANSWERING`` that answer and ``MAX_OTHERS`` that do not, drawn by the
seed, and the loss is the listwise one of picking an answering sentence: minus the log of the
softmax mass (over the question's candidates, cosines times ``SCALE``) on the answering ones. It
is the answer step's own decision (which of the retrieved sentences answers), and the negatives
are the hard ones: sentences of the sections retrieval found for that question. A question
whose rows hold no answering sentence teaches no ordering and is left out of training.

A ``hyperparameters.batch_size`` of N puts N questions in a step (their losses averaged).
Held-out evaluation scores every held-out row by its cosine and reports the cross-encoder
reader's figures (``recipes/reader.py``: AUC, MRR, best-F1 threshold), so the two kinds compare
on one scale of ranking.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.readers import reader_passage
from services.trainer.data.formats import ReaderRecord, of_kind
from services.trainer.modeling import count_params
from services.trainer.recipes.base import Recipe, seed_everything
from services.trainer.recipes.reader import DEFAULT_MAX_LENGTH, EVAL_BATCH, reader_metrics

MAX_ANSWERING = 2  # answering sentences a question shows per step
MAX_OTHERS = 15  # and non-answering ones
SCALE = 20.0  # cosines times this are the softmax's logits (sentence-transformers' MNRL scale)


def question_groups(rows: list[ReaderRecord]) -> list[list[int]]:
    """Row indices per (group, question), in first-seen order; only questions with both an
    answering and a non-answering row."""
    by: dict[tuple[str | None, str], list[int]] = {}
    for i, r in enumerate(rows):
        by.setdefault((r.group, r.question), []).append(i)
    return [
        idx for idx in by.values() if any(rows[i].label for i in idx) and not all(rows[i].label for i in idx)
    ]


def step_schedule(
    rows: list[ReaderRecord], groups: list[list[int]], batch_size: int, epochs: int, seed: int
) -> list[list[list[int]]]:
    """Each step's questions, each as the row indices it shows (answering ones first): every
    epoch reshuffles the questions and draws their sentences anew, all from the seed."""
    rng = random.Random(seed)
    steps: list[list[list[int]]] = []
    for _ in range(epochs):
        order = list(range(len(groups)))
        rng.shuffle(order)
        shown = []
        for g in order:
            answering = [i for i in groups[g] if rows[i].label]
            others = [i for i in groups[g] if not rows[i].label]
            rng.shuffle(answering)
            rng.shuffle(others)
            shown.append(answering[:MAX_ANSWERING] + others[:MAX_OTHERS])
        steps += [shown[k : k + batch_size] for k in range(0, len(shown), batch_size)]
    return steps


class BiEncoderReaderRecipe(Recipe):
    def load_model(self, attn: str = "") -> None:
        from sentence_transformers import SentenceTransformer

        seed_everything(self.hp.seed)
        model = SentenceTransformer(str(self.cfg.model_path), device=str(self.device))
        model.max_seq_length = self.hp.max_seq_length or DEFAULT_MAX_LENGTH
        model.train()
        self.model = model
        self.tokenizer = model.tokenizer
        trainable, total = count_params(model)
        self.hooks.log(
            f"bi-encoder reader {self.cfg.model_path.name}: {trainable:,} trainable of {total:,} "
            f"parameters, max_seq_length {model.max_seq_length}"
        )

    def setup(self) -> None:
        self.rows = of_kind(self.cfg.records, ReaderRecord)
        self.held = of_kind(self.cfg.eval_records or [], ReaderRecord)
        self.load_model()
        groups = question_groups(self.rows)
        self.schedule = step_schedule(self.rows, groups, self.hp.batch_size, self.hp.n_epochs, self.hp.seed)
        self.total_steps = min(len(self.schedule), self.hp.max_steps or len(self.schedule))
        self.make_optimizer()
        self.hooks.log(
            f"{len(self.rows)} rows, {len(groups)} questions with an answering sentence, "
            f"{self.hp.batch_size} a step, {self.total_steps} steps; held out: {len(self.held)} rows"
        )

    def _embed(self, texts: list[str]) -> torch.Tensor:
        feats = self.model.preprocess(texts)
        feats = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in feats.items()}
        with self.autocast():
            vectors = self.model(feats)["sentence_embedding"]
        return torch.nn.functional.normalize(vectors.float(), dim=-1)

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        losses = []
        tokens = 0
        for shown in self.schedule[step - 1]:
            rows = [self.rows[i] for i in shown]
            vectors = self._embed([rows[0].question] + [reader_passage(r.sentence, r.context) for r in rows])
            logp = torch.log_softmax(SCALE * (vectors[1:] @ vectors[0]), 0)
            answering = torch.tensor([r.label == 1 for r in rows], device=logp.device)
            losses.append(-torch.logsumexp(logp[answering], 0))
            tokens += sum(len(r.question) + len(r.sentence) for r in rows)
        loss = torch.stack(losses).mean()
        loss.backward()
        questions = float(len(losses))
        # characters stand for tokens here: the step's size, not its padding
        return self.finish_step(t0, float(loss.detach()), tokens, tokens, {"batch_size": questions})

    def scores(self, rows: list[ReaderRecord]) -> np.ndarray:
        """The cosine of each row's question and passage (each distinct text embedded once: a
        question has many rows)."""
        questions = list(dict.fromkeys(r.question for r in rows))
        passages = list(dict.fromkeys(reader_passage(r.sentence, r.context) for r in rows))
        with torch.no_grad():
            q = self._embed_all(questions)
            p = self._embed_all(passages)
        qi = {t: i for i, t in enumerate(questions)}
        pi = {t: i for i, t in enumerate(passages)}
        pairs = [(qi[r.question], pi[reader_passage(r.sentence, r.context)]) for r in rows]
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        a, b = (torch.tensor(ix) for ix in zip(*pairs, strict=True))
        return (q[a] * p[b]).sum(-1).cpu().numpy()

    def _embed_all(self, texts: list[str]) -> torch.Tensor:
        parts = [self._embed(texts[i : i + EVAL_BATCH]) for i in range(0, len(texts), EVAL_BATCH)]
        return torch.cat(parts) if parts else torch.zeros(0)

    def evaluate(self) -> dict[str, float]:
        if not self.held:
            return {}
        was_training = self.model.training
        self.model.eval()
        try:
            labels = np.array([r.label for r in self.held])
            questions = [f"{r.group}\x00{r.question}" for r in self.held]
            return reader_metrics(self.scores(self.held), labels, questions)
        finally:
            self.model.train(was_training)

    def save_final(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.model.save(str(out))
        info: dict[str, Any] = {
            "type": self.cfg.kind,
            "reader_kind": "bi-encoder",
            "base_model": str(self.cfg.model_path),
            "hyperparameters": self.hp.model_dump(),
            "steps": self.total_steps,
            "rows": len(self.rows),
            "final_metrics": self.last_metrics,
        }
        (out / "tandem_training.json").write_text(json.dumps(info, indent=2))
