"""Reader jobs with ``"reader_kind": "features"``: a small model over the answer step's signals.

Each row is a reader row (question, sentence, label, group) that also carries ``features``: the
numbers services/agent/reader/features.py computes for a candidate sentence (embedder cosines,
the rules' score, word overlaps, retrieval rank, the question's kind crossed with the
sentence's marks). The model standardises them and maps them to one logit: a logistic
regression (a job's model; ``fit`` can add one hidden ReLU layer, which
``benchmarks/answers/reader_eval.py learn --hidden`` compares). The loss is binary cross-entropy, the optimizer AdamW over seeded shuffled batches (a
few hundred steps train in seconds on a CPU).

The artifact is ``feature_reader.json`` (the names, the standardisation, the layers and the
"not found" threshold: the held-out rows' best-F1 cut, as ``reader.best_threshold`` finds it),
which the agent's ``FeatureScorer`` loads; it holds no code and no pickle.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.trainer.data.formats import ReaderRecord, of_kind
from services.trainer.recipes.base import Recipe, seed_everything
from services.trainer.recipes.reader import batch_schedule, best_threshold, reader_metrics

ARTIFACT = "feature_reader.json"
DEFAULT_THRESHOLD = 0.5  # without held-out rows to choose one


def feature_matrix(rows: list[ReaderRecord], names: list[str] | None = None) -> tuple[list[str], np.ndarray]:
    """The rows' features as a matrix, columns in ``names`` (default: the first row's order)."""
    if names is None:
        names = list(rows[0].features or {}) if rows else []
    x = np.array([[(r.features or {})[n] for n in names] for r in rows], dtype=np.float32)
    return names, x.reshape(len(rows), len(names))


class FeatureNet(torch.nn.Module):
    """Standardisation (fixed from the training rows), then linear layers to one logit."""

    def __init__(self, mean: np.ndarray, scale: np.ndarray, hidden: int) -> None:
        super().__init__()
        width = len(mean)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32))
        sizes = [width, hidden, 1] if hidden else [width, 1]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def _linear(self) -> list[torch.nn.Linear]:
        return [layer for layer in self.layers if isinstance(layer, torch.nn.Linear)]

    def _buffer(self, name: str) -> torch.Tensor:
        return self.get_buffer(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x - self._buffer("mean")) / self._buffer("scale")
        layers = self._linear()
        for i, layer in enumerate(layers):
            h = layer(h)
            if i < len(layers) - 1:
                h = torch.relu(h)
        return h.view(-1)

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return torch.sigmoid(self(torch.tensor(x, dtype=torch.float32))).numpy()

    def artifact(self, names: list[str], threshold: float, margin: float = 0.05) -> dict[str, Any]:
        """The model as services/agent/reader/features.py reads it (weights as [in, out])."""
        return {
            "features": names,
            "mean": self._buffer("mean").tolist(),
            "scale": self._buffer("scale").tolist(),
            "layers": [
                {"weights": layer.weight.detach().T.tolist(), "bias": layer.bias.detach().tolist()}
                for layer in self._linear()
            ],
            "threshold": threshold,
            "margin": margin,
        }


def new_net(x: np.ndarray, hidden: int, seed: int) -> FeatureNet:
    seed_everything(seed)
    mean = x.mean(axis=0) if len(x) else np.zeros(x.shape[1], dtype=np.float32)
    scale = x.std(axis=0) if len(x) else np.ones(x.shape[1], dtype=np.float32)
    return FeatureNet(mean, np.where(scale > 1e-6, scale, 1.0), hidden)


def fit(
    x: np.ndarray,
    y: np.ndarray,
    *,
    hidden: int = 0,
    epochs: int = 20,
    batch_size: int = 1024,
    lr: float = 0.02,
    weight_decay: float = 1e-3,
    seed: int = 0,
) -> FeatureNet:
    """A model fitted to ``x`` -> ``y``: the steps a job takes (the same batches), in one call."""
    net = new_net(x, hidden, seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    xs, ys = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    for batch in batch_schedule(len(x), batch_size, epochs, seed):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(xs[batch]), ys[batch])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return net


class FeatureReaderRecipe(Recipe):
    def load_model(self, attn: str = "") -> None:
        self.names, self.x = feature_matrix(self.rows)
        self.y = np.array([r.label for r in self.rows], dtype=np.float32)
        self.model = new_net(self.x, 0, self.hp.seed)
        self.hooks.log(f"feature reader: a logistic regression over {len(self.names)} features")

    def setup(self) -> None:
        self.rows = of_kind(self.cfg.records, ReaderRecord)
        self.held = of_kind(self.cfg.eval_records or [], ReaderRecord)
        self.load_model()
        self.schedule = batch_schedule(len(self.rows), self.hp.batch_size, self.hp.n_epochs, self.hp.seed)
        self.total_steps = min(len(self.schedule), self.hp.max_steps or len(self.schedule))
        self.make_optimizer()
        self.xs = torch.tensor(self.x)
        self.ys = torch.tensor(self.y)
        self.hooks.log(
            f"{len(self.rows)} rows ({int(self.y.sum())} answering), batches of {self.hp.batch_size}, "
            f"{self.total_steps} steps; "
            f"held out: {len(self.held)} rows"
        )

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.schedule[step - 1]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            self.model(self.xs[batch]), self.ys[batch]
        )
        loss.backward()
        n = len(batch) * len(self.names)  # numbers read: the "tokens" of a features reader
        return self.finish_step(t0, float(loss.detach()), n, n, {"batch_size": float(len(batch))})

    def held_scores(self) -> np.ndarray:
        if not self.held:
            return np.zeros(0, dtype=np.float32)
        return self.model.probabilities(feature_matrix(self.held, self.names)[1])

    def evaluate(self) -> dict[str, float]:
        if not self.held:
            return {}
        labels = np.array([r.label for r in self.held])
        questions = [f"{r.group}\x00{r.question}" for r in self.held]
        return reader_metrics(self.held_scores(), labels, questions)

    def save_final(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        cut = (
            best_threshold(self.held_scores(), np.array([r.label for r in self.held])) if self.held else None
        )
        threshold = cut[1] if cut is not None else DEFAULT_THRESHOLD
        (out / ARTIFACT).write_text(json.dumps(self.model.artifact(self.names, threshold)))
        (out / "tandem_training.json").write_text(
            json.dumps(
                {
                    "type": self.cfg.kind,
                    "reader_kind": "features",
                    "hyperparameters": self.hp.model_dump(),
                    "steps": self.total_steps,
                    "rows": len(self.rows),
                    "final_metrics": self.last_metrics,
                },
                indent=2,
            )
        )
