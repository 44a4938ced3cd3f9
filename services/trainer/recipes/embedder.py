"""Embedder jobs: fine-tune a sentence-transformers encoder on (query, positive, negatives) pairs.

The loss is sentence-transformers' own: ``MultipleNegativesRankingLoss`` (every other positive
and negative of the batch is a negative of each query), its GradCache variant
``CachedMultipleNegativesRankingLoss`` (``loss: cached_mnrl``: batches far larger than memory
holds, embedded in ``mini_batch_size`` pieces), optionally wrapped in ``MatryoshkaLoss``.
The step loop is the trainer's (``base.run``), not ``SentenceTransformerTrainer``, so an
embedder job checkpoints, resumes at the exact step, cancels and reports like every other
job: the loss module is called on the batch's tokenised columns and backpropagated here.

With ``hard_negatives`` set, each pair also gets that many negatives mined by the base model
over the job's corpus before the first step (sentence-transformers' ``mine_hard_negatives``,
see ``data/pairs.py``): the loss then sees (anchor, positive, negative_1..n) columns, each
query's mined negatives beside every other row's texts.

Batches are a pure function of the seed: each epoch a seeded shuffle, cut into batches in
which no text appears twice (a duplicate would be one query's positive and also its
in-batch negative, like sentence-transformers' ``NO_DUPLICATES`` sampler).

Held-out evaluation is sentence-transformers' ``InformationRetrievalEvaluator``: the
held-out queries ranked against the corpus (see ``data/pairs.py``), nDCG@10, Recall@100,
Recall@10 and MRR@10 by cosine similarity.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from services.trainer.data.pairs import (
    TITLE_STAGE,
    EmbedderPair,
    RetrievalSet,
    chunk_positives,
    mine_negatives,
    retrieval_set,
)
from services.trainer.modeling import count_params
from services.trainer.recipes.base import Recipe, make_staged_scheduler, seed_everything

EVAL_METRICS = ("ndcg@10", "recall@100", "recall@10", "mrr@10")
MAX_NEGATIVES = 4  # a row's own negatives used (every row of a batch must give as many), plus the mined


def batch_schedule(pairs: list[EmbedderPair], batch_size: int, epochs: int, seed: int) -> list[list[int]]:
    """Batches of pair indices, every epoch reshuffled (seeded) and no text twice in a batch."""
    out: list[list[int]] = []
    for epoch in range(epochs):
        pending = list(range(len(pairs)))
        random.Random(seed * 1_000_003 + epoch).shuffle(pending)
        while pending:
            batch: list[int] = []
            texts: set[str] = set()
            rest: list[int] = []
            for i in pending:
                row = pairs[i]
                mine = {row["query"], row["positive"], *row.get("negatives", [])}
                if len(batch) < batch_size and not (mine & texts):
                    batch.append(i)
                    texts |= mine
                else:
                    rest.append(i)
            out.append(batch)
            pending = rest
    return out


class EmbedderRecipe(Recipe):
    def load_model(self, attn: str = "") -> None:
        from sentence_transformers import SentenceTransformer

        seed_everything(self.hp.seed)
        model = SentenceTransformer(str(self.cfg.model_path), device=str(self.device))
        if self.hp.max_seq_length is not None:
            model.max_seq_length = self.hp.max_seq_length
        model.train()
        self.model = model
        self.tokenizer = model.tokenizer
        trainable, total = count_params(model)
        self.hooks.log(
            f"embedder {self.cfg.model_path.name}: {trainable:,} trainable of {total:,} parameters, "
            f"{model.get_embedding_dimension()} dimensions, max_seq_length {model.max_seq_length}"
        )

    def autocast(self) -> Any:
        precision = self.hp.precision
        if precision == "fp32":
            return torch.autocast(self.device.type, enabled=False)
        if precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        # auto: an accelerator autocasts to its platform's dtype, a CPU stays fp32 (bf16 autocast
        # was only ~5% faster on an AMX CPU: benchmarks/RESULTS.md, "fine-tuned embedders")
        return super().autocast()

    def _loss(self) -> torch.nn.Module:
        from sentence_transformers.sentence_transformer import losses

        hp = self.hp
        loss: torch.nn.Module
        if hp.loss == "cached_mnrl":
            loss = losses.CachedMultipleNegativesRankingLoss(self.model, mini_batch_size=hp.mini_batch_size)
        else:
            loss = losses.MultipleNegativesRankingLoss(self.model)
        if hp.matryoshka_dims:
            loss = losses.MatryoshkaLoss(self.model, loss, hp.matryoshka_dims)
        return loss

    def _hard_negatives(self, pairs: list[EmbedderPair]) -> list[EmbedderPair]:
        """The pairs with ``hard_negatives`` mined negatives each (see ``data/pairs.py``), by the
        base model before any update. Kept in the work folder, so a resumed job trains on the
        very negatives it started with (mining again after a crash is minutes, and a different
        device could rank near-ties the other way)."""
        hp = self.hp
        texts = [*(self.cfg.corpus or {}).values()]
        key = hashlib.sha256(
            json.dumps(
                [hp.hard_negatives, hp.hard_negatives_margin, hp.hard_negatives_skip, pairs, texts],
                sort_keys=True,
            ).encode()
        ).hexdigest()
        cache = self.cfg.work_dir / "hard_negatives.json" if self.cfg.work_dir is not None else None
        if cache is not None and cache.is_file():
            saved = json.loads(cache.read_text())
            if saved.get("key") == key:
                self.hooks.log(f"hard negatives: the {len(saved['pairs'])} pairs mined before ({cache})")
                return list(saved["pairs"])
        t0 = time.perf_counter()
        got = mine_negatives(
            self.model,
            pairs,
            texts,
            count=hp.hard_negatives,
            margin=hp.hard_negatives_margin,
            skip=hp.hard_negatives_skip,
        )
        self.model.train()  # encoding left it in eval mode
        self.hooks.log(
            f"hard negatives: {got.mined} mined for {len(pairs)} pairs over {len(texts)} corpus texts "
            f"(margin {hp.hard_negatives_margin}, skip {hp.hard_negatives_skip}); {got.repeated} places "
            f"repeat a row's own where too few passed, {got.short} rows have none, {got.widened} queries "
            "looked down the whole ranking; "
            f"{time.perf_counter() - t0:.1f} s"
        )
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": key, "pairs": got.pairs}))
            tmp.replace(cache)
        return got.pairs

    def setup(self) -> None:
        self.load_model()
        self.pairs = self.cfg.records
        if self.cfg.chunks:
            # before any update, so a resumed job picks the same chunks
            self.pairs, mapped = chunk_positives(self.model, self.pairs, self.cfg.chunks)
            self.model.train()  # encoding left it in eval mode
            self.hooks.log(f"positives: {mapped} pairs train on their document's chunk nearest the query")
        if self.hp.hard_negatives and self.hp.hard_negatives_from == "model":
            self.pairs = self._hard_negatives(self.pairs)
        self.schedule, self.stage_starts = self._staged_schedule()
        self.total_steps = min(len(self.schedule), self.hp.max_steps or len(self.schedule))
        self.loss_fn = self._loss()
        self.retrieval: RetrievalSet | None = (
            # the pairs as given: mined negatives must not change what held-out queries rank
            retrieval_set(self.cfg.records, self.cfg.eval_records, self.cfg.corpus or {})
            if self.cfg.eval_records
            else None
        )
        self.make_optimizer()
        self.hooks.log(
            f"{len(self.pairs)} pairs, batches of {self.hp.batch_size} ({self.hp.loss}), "
            f"{self.total_steps} steps"
            + (
                f"; held out: {len(self.retrieval.queries)} queries over {len(self.retrieval.corpus)} texts"
                if self.retrieval
                else ""
            )
        )

    def _staged_schedule(self) -> tuple[list[list[int]], list[int]]:
        """The batches of every stage in order, and each stage's first step (from 0). With
        stages "titles_first" the title and heading pairs train first (``title_epochs``), then
        the rest (``n_epochs``): a stage's batches hold its own pairs only."""
        hp = self.hp
        titles = [i for i, p in enumerate(self.pairs) if p.get("_stage") == TITLE_STAGE]
        rest = [i for i, p in enumerate(self.pairs) if p.get("_stage") != TITLE_STAGE]
        if self.cfg.stages == "titles_first" and titles and rest:
            plan = [(titles, hp.title_epochs), (rest, hp.n_epochs)]
        else:
            plan = [(list(range(len(self.pairs))), hp.n_epochs)]
        schedule: list[list[int]] = []
        starts: list[int] = []
        for k, (idx, epochs) in enumerate(plan):
            starts.append(len(schedule))
            own = [self.pairs[i] for i in idx]
            schedule += [[idx[j] for j in b] for b in batch_schedule(own, hp.batch_size, epochs, hp.seed + k)]
        if len(plan) > 1:
            self.hooks.log(
                f"stages: {len(titles)} title and heading pairs for {hp.title_epochs} epoch(s) "
                f"({starts[1]} steps), then {len(rest)} labelled pairs for {hp.n_epochs} epoch(s) "
                f"({len(schedule) - starts[1]} steps)"
            )
        return schedule, starts

    def make_optimizer(self) -> None:
        super().make_optimizer()
        if len(self.stage_starts) > 1:  # each stage warms up and decays on its own
            assert self.optimizer is not None
            bounds = [*self.stage_starts, max(self.total_steps, self.stage_starts[-1] + 1)]
            self.scheduler = make_staged_scheduler(
                self.optimizer, self.hp.lr_scheduler, self.hp.warmup_steps, bounds
            )

    def _features(self, texts: list[str]) -> dict[str, torch.Tensor]:
        feats = self.model.preprocess(texts)
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in feats.items()}

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if step - 1 in self.stage_starts[1:]:
            # a stage starts as a job of its own would: Adam's moments of the last stage dropped
            assert self.optimizer is not None
            self.optimizer.state.clear()
            self.hooks.log(f"stage {self.stage_starts.index(step - 1) + 1} from step {step}")
        rows = [self.pairs[i] for i in self.schedule[step - 1]]
        # a row's own negatives first, then its mined ones (hard_negatives): every row gives k
        k = min(MAX_NEGATIVES + self.hp.hard_negatives, *(len(r.get("negatives") or []) for r in rows))
        columns = [[r["query"] for r in rows], [r["positive"] for r in rows]]
        columns += [[r["negatives"][j] for r in rows] for j in range(k)]
        features = [self._features(col) for col in columns]
        with self.autocast():
            loss = self.loss_fn(features, None)
        loss.backward()
        real = sum(int(f["attention_mask"].sum()) for f in features)
        processed = sum(int(f["attention_mask"].numel()) for f in features)
        return self.finish_step(
            t0, float(loss.detach()), real, processed, {"batch_size": float(len(rows)), "negatives": float(k)}
        )

    def evaluate(self) -> dict[str, float]:
        from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

        rs = self.retrieval
        if rs is None:
            return {}
        queries: dict[str, Any] = dict(rs.queries)  # the evaluator takes any modality's inputs
        corpus: dict[str, Any] = dict(rs.corpus)
        evaluator = InformationRetrievalEvaluator(
            queries,
            corpus,
            rs.relevant,
            mrr_at_k=[10],
            ndcg_at_k=[10],
            accuracy_at_k=[1],
            precision_recall_at_k=[10, 100],
            map_at_k=[100],
            batch_size=64,
            write_csv=False,
        )
        scores = evaluator(self.model)
        # keys are "<name>_<score function>_<metric>": the model's similarity (cosine)
        return {m: float(v) for key, v in scores.items() for m in EVAL_METRICS if key.endswith("_" + m)}

    def save_final(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.model.save(str(out))
        (out / "tandem_training.json").write_text(
            json.dumps(
                {
                    "type": self.cfg.kind,
                    "base_model": str(self.cfg.model_path),
                    "dim": self.model.get_embedding_dimension(),
                    "hyperparameters": self.hp.model_dump(),
                    "steps": self.total_steps,
                    "pairs": len(self.pairs),
                    "final_metrics": self.last_metrics,
                },
                indent=2,
            )
        )
