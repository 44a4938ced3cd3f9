"""Golden loss curves (torchtune's practice): every recipe trains a tiny fixed model (seeded
random init) on a tiny fixed dataset, and its first 10 losses must match the ones pinned in
``tests/data/golden_losses.json``. A change in numerics (a loss, the packing, the masks, the
optimizer or the schedule, a library upgrade that changes a kernel) shows up here as a diff,
even when the behavioural tests still pass.

The tolerance (relative 1e-4) is far above CPU float noise (a different thread count changes
the order of fp32 reductions: about 1e-6 after 10 steps) and far below what a real change does.

Regenerate after a deliberate change, and say why in the commit:

    GOLDEN_REGEN=1 .venv/bin/python -m pytest tests/trainer/test_golden_losses.py

then review the diff of ``tests/data/golden_losses.json``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from services.trainer.data.formats import PreferenceRecord, PromptRecord, of_kind, parse_dataset
from services.trainer.data.pairs import embedder_data
from services.trainer.protocol import Hyperparameters, LoraSpec
from services.trainer.recipes.base import NullHooks, TrainConfig, run
from services.trainer.runner import recipe_for
from tests.helpers.models import make_tiny_llama
from tests.retrieval.conftest import make_tiny_embedder
from tests.trainer.conftest import HH, count_to_rows, jsonl

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_losses.json"
STEPS = 10
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def golden_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # every argument spelled out: a change of make_tiny_llama's defaults must not move the goldens
    return make_tiny_llama(
        tmp_path_factory.mktemp("golden-llama"), layers=2, hidden=64, heads=4, kv_heads=2, seed=0
    )


@pytest.fixture(scope="module")
def golden_embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # built here, not taken from the test cache: a cached model of older code must not move it
    return make_tiny_embedder(tmp_path_factory.mktemp("golden-embedder") / "st", hidden=32)


def letter_e(records: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
    """A reward that a random model's completions already vary in: their share of 'e'."""
    return [c.count("e") / (len(c) + 1) for c in completions]


def _kto_rows() -> list[dict[str, Any]]:
    rows = []
    for r in of_kind(parse_dataset(HH.read_bytes()).records[:10], PreferenceRecord):
        rows.append({"prompt": r.prompt, "completion": r.chosen[0]["content"], "label": True})
        rows.append({"prompt": r.prompt, "completion": r.rejected[0]["content"], "label": False})
    return rows


def _pair_rows() -> list[dict[str, Any]]:
    topics = [
        "apple",
        "river",
        "engine",
        "violin",
        "planet",
        "bread",
        "winter",
        "copper",
        "falcon",
        "garden",
        "laser",
        "ocean",
    ]
    return [
        {
            "query": f"what about {t} number {i}?",
            "positive": f"A passage on {t}: the {t} is discussed, part {i}.",
        }
        for t in topics
        for i in range(2)
    ]


def _rl_rows() -> list[dict[str, Any]]:
    rng = random.Random(0)
    return [{"prompt": f"Say something {i}", "completion": rng.choice(["yes", "no"])} for i in range(16)]


# job type -> (dataset, hyperparameters, LoRA): small, fixed, 10 optimizer steps each
RECIPES: dict[str, tuple[Any, dict[str, Any], LoraSpec | None]] = {
    "sft": (
        lambda: count_to_rows(20),
        {"learning_rate": 1e-2},
        LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    ),
    "dpo": (lambda: HH, {"learning_rate": 1e-3, "beta": 0.5}, None),
    "simpo": (lambda: HH, {"learning_rate": 1e-3, "beta": 2.0}, None),
    "orpo": (lambda: HH, {"learning_rate": 1e-3, "beta": 0.1}, None),
    "kto": (_kto_rows, {"learning_rate": 1e-3, "beta": 0.5}, None),
    "grpo": (_rl_rows, {"learning_rate": 1e-3, "prompts_per_step": 2, "group_size": 4}, None),
    "ppo": (_rl_rows, {"learning_rate": 1e-3, "prompts_per_step": 4}, None),
    # sentence-transformers' MNRL on a tiny random BERT (its own model: see ``golden_embedder``)
    "embedder": (_pair_rows, {"learning_rate": 1e-3, "batch_size": 6, "precision": "fp32"}, None),
}


def losses_of(kind: str, model: Path) -> list[float]:
    data, hp, lora = RECIPES[kind]
    source = data()
    raw = source.read_bytes() if isinstance(source, Path) else jsonl(source)
    records = parse_dataset(raw).records
    cfg = TrainConfig(
        kind=kind,
        model_path=model,
        records=embedder_data(records).pairs if kind == "embedder" else records,
        hp=Hyperparameters(
            **{
                "max_steps": STEPS,
                "n_epochs": 20,
                "packs_per_step": 1,
                "seed": 0,
                "lr_scheduler": "constant",
                "max_new_tokens": 8,
                "kl_coef": 0.05,
                **hp,
            }
        ),
        lora=lora,
        max_tokens_per_pack=512,
        pad_to_multiple_of=16,
        reward=letter_e if kind in ("grpo", "ppo") else None,
        device=None,
    )
    hooks = NullHooks()
    assert run(recipe_for(kind)(cfg, hooks=hooks)) == "succeeded"
    assert [h["step"] for h in hooks.history] == list(range(1, STEPS + 1))
    return [float(h["loss"]) for h in hooks.history]


@pytest.mark.parametrize("kind", list(RECIPES))
def test_first_losses_match_the_golden_curve(kind: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue("golden_embedder" if kind == "embedder" else "golden_model")
    got = losses_of(kind, model)
    if os.environ.get("GOLDEN_REGEN"):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
        golden[kind] = got
        GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
        return
    want = json.loads(GOLDEN.read_text())[kind]
    assert len(set(got)) > 1, f"{kind}: a flat curve pins nothing: {got}"
    assert got == pytest.approx(want, rel=RTOL, abs=ATOL), (
        f"{kind}'s losses moved from the golden curve (regenerate only for a deliberate change, "
        f"see this module's docstring):\n got  {got}\n want {want}"
    )
