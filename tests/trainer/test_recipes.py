"""Recipes end to end on the tiny model: LoRA touches only the adapter, a killed run resumes
to the same final loss, and a cancel stops before the next step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.data.formats import parse_dataset
from services.trainer.protocol import Hyperparameters, LoraSpec
from services.trainer.recipes.base import NullHooks, TrainConfig, run
from services.trainer.recipes.dpo import DPORecipe
from services.trainer.recipes.sft import SFTRecipe
from tests.trainer.conftest import count_to_rows, jsonl

ROWS = count_to_rows(24)


def sft_config(model: Path, work: Path | None, **kw: object) -> TrainConfig:
    hp = Hyperparameters(**{"learning_rate": 1e-2, "max_steps": 6, "packs_per_step": 1, "seed": 3, **kw})  # type: ignore[arg-type]
    return TrainConfig(
        kind="sft",
        model_path=model,
        records=parse_dataset(jsonl(ROWS)).records,
        hp=hp,
        lora=LoraSpec(r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"]),
        max_tokens_per_pack=256,
        pad_to_multiple_of=16,
        checkpoint_every=2,
        work_dir=work,
    )


class KillAt(NullHooks):
    """Stands in for kill -9: the process 'dies' right after step ``n`` is reported."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def report(self, step: int, total: int, metrics: dict[str, float]) -> None:
        super().report(step, total, metrics)
        if step == self.n:
            raise KeyboardInterrupt("killed")


def test_lora_changes_only_adapter_weights(tiny_model_path: Path) -> None:
    recipe = SFTRecipe(sft_config(tiny_model_path, None, max_steps=2))  # type: ignore[arg-type]
    recipe.setup()
    before = {n: p.detach().clone() for n, p in recipe.model.named_parameters()}
    for step in (1, 2):
        recipe.train_step(step)
    changed = {n for n, p in recipe.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "nothing trained"
    assert all("lora_" in n for n in changed), sorted(changed)[:5]
    assert any("lora_B" in n for n in changed)


def test_killed_run_resumes_to_the_same_final_loss(tiny_model_path: Path, tmp_path: Path) -> None:
    full = NullHooks()
    straight = SFTRecipe(sft_config(tiny_model_path, tmp_path / "a"), hooks=full)
    assert run(straight, tmp_path / "a" / "ckpt") == "succeeded"

    killed = SFTRecipe(sft_config(tiny_model_path, tmp_path / "b"), hooks=KillAt(5))
    with pytest.raises(KeyboardInterrupt):
        run(killed, tmp_path / "b" / "ckpt")
    resumed_hooks = NullHooks()
    resumed = SFTRecipe(sft_config(tiny_model_path, tmp_path / "b"), hooks=resumed_hooks)
    assert run(resumed, tmp_path / "b" / "ckpt") == "succeeded"

    # resumed from the step-4 checkpoint: steps 5 and 6 ran again, the total is the same
    assert [h["step"] for h in resumed_hooks.history] == [5, 6]
    assert len(full.history) == 6
    assert resumed_hooks.history[-1]["loss"] == pytest.approx(full.history[-1]["loss"], abs=1e-5)
    assert resumed_hooks.history[0]["loss"] == pytest.approx(full.history[4]["loss"], abs=1e-5)


class Logged(NullHooks):
    def __init__(self) -> None:
        super().__init__()
        self.logs: list[str] = []

    def log(self, message: str) -> None:
        self.logs.append(message)


@pytest.mark.parametrize("damage", ["truncated state", "corrupt weights"])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_one_before(
    tiny_model_path: Path, tmp_path: Path, damage: str
) -> None:
    full = NullHooks()
    assert run(
        SFTRecipe(sft_config(tiny_model_path, tmp_path / "a"), hooks=full), tmp_path / "a" / "ckpt"
    ) == ("succeeded")
    root = tmp_path / "b" / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        run(SFTRecipe(sft_config(tiny_model_path, tmp_path / "b"), hooks=KillAt(5)), root)
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4"]
    if damage == "truncated state":
        state = root / "step-4" / "state.pt"
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    else:
        (root / "step-4" / "trainable.safetensors").write_bytes(b"\x00" * 64)
    hooks = Logged()
    assert run(SFTRecipe(sft_config(tiny_model_path, tmp_path / "b"), hooks=hooks), root) == "succeeded"
    # step 4 is skipped for step 2: steps 3 to 6 run again and end where an uninterrupted run does
    assert [h["step"] for h in hooks.history] == [3, 4, 5, 6]
    assert hooks.history[-1]["loss"] == pytest.approx(full.history[-1]["loss"], abs=1e-5)
    assert any("step-4 is unreadable" in m for m in hooks.logs), hooks.logs
    assert any(m.startswith("resumed from checkpoint step 2") for m in hooks.logs)


def test_checkpoints_are_fsynced_before_and_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from services.trainer import checkpoint as ckpt

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    final = ckpt.save_checkpoint(tmp_path, 2, weights={"w": param.detach()}, optimizer=opt, scheduler=sched)
    tmp_names = [Path(p).name for p in synced[:3]]
    assert tmp_names == ["trainable.safetensors", "state.pt", ".tmp-step-2-" + str(os.getpid())]
    assert synced[3] == str(tmp_path)  # the rename is durable too
    assert ckpt.load_latest(final.parent)[0] == 2  # type: ignore[index]


class CancelAfter(NullHooks):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def should_stop(self) -> bool:
        return len(self.history) >= self.n


def test_cancel_stops_within_one_step(tiny_model_path: Path) -> None:
    hooks = CancelAfter(2)
    assert run(SFTRecipe(sft_config(tiny_model_path, None), hooks=hooks)) == "cancelled"
    assert [h["step"] for h in hooks.history] == [1, 2]


def test_dpo_recipe_learns_preferences(tiny_model_path: Path, tmp_path: Path) -> None:
    rows = [{"prompt": f"Say yes {i}", "chosen": "yes yes", "rejected": "no no no"} for i in range(16)]
    cfg = TrainConfig(
        kind="dpo",
        model_path=tiny_model_path,
        records=parse_dataset(jsonl(rows)).records,
        hp=Hyperparameters(learning_rate=5e-3, max_steps=8, n_epochs=8, beta=0.5, seed=0),
        max_tokens_per_pack=256,
        pad_to_multiple_of=16,
        work_dir=tmp_path,
    )
    hooks = NullHooks()
    assert run(DPORecipe(cfg, hooks=hooks)) == "succeeded"
    assert (tmp_path / "reference_logps.pt").is_file()  # computed once, cached
    first, last = hooks.history[0], hooks.history[-1]
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at step 1
    assert last["loss"] < first["loss"] - 0.1
    assert last["reward_accuracy"] == 1.0
