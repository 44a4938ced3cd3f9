"""KTO rows, the prompt-group mask, packed == unpacked for every preference job type, and the
KTO / SimPO / ORPO recipes learning a tiny preference with held-out metrics before/after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tandem_kernels
import torch
from transformers import AutoTokenizer

from services.common.errors import InvalidRequest
from services.trainer.data.formats import (
    DatasetError,
    KTORecord,
    PreferenceRecord,
    PromptRecord,
    of_kind,
    parse_dataset,
    records_for,
)
from services.trainer.data.packing import group_mask, pack_groups, pack_pairs, shuffled_bfd
from services.trainer.data.tokenize import tokenize_pair
from services.trainer.jobspec import split_eval
from services.trainer.losses import kto_kl, kto_loss
from services.trainer.modeling import load_causal_lm
from services.trainer.protocol import Hyperparameters, JobCreate, LoraSpec
from services.trainer.recipes.base import NullHooks, TrainConfig, run
from services.trainer.recipes.dpo import (
    DPORecipe,
    answer_lengths,
    pack_pair_logps,
    padded_pair_batch,
    padded_pair_logps,
    pair_losses,
)
from services.trainer.recipes.kto import (
    KTOData,
    KTORecipe,
    kl_partners,
    pack_answer_logps,
    padded_answer_logps,
)
from tests.trainer.conftest import jsonl


# ---- the kto format
def test_kto_rows_parse_and_bad_rows_name_line_and_field() -> None:
    good = parse_dataset(
        jsonl(
            [
                {"prompt": [{"role": "user", "content": "hi"}], "completion": "hello", "label": True},
                {"prompt": "hi", "completion": "go away", "label": False},
            ]
        )
    )
    assert good.format == "kto" and good.kinds == ("kto",)
    rec = of_kind(records_for(good, "kto"), KTORecord)[1]
    assert rec.prompt == [{"role": "user", "content": "hi"}]
    assert rec.completion == [{"role": "assistant", "content": "go away"}] and rec.label is False
    first = {"prompt": "q", "completion": "a", "label": True}
    cases = [
        (
            {"prompt": "q", "completion": "a", "label": "yes"},
            "line 2: field 'label' must be true or false",
            "label",
        ),
        ({"prompt": "q", "completion": "a", "label": 1}, "field 'label' must be true or false", "label"),
        (
            {"prompt": "q", "label": True},
            "line 2: field 'completion' is missing (kto rows need it)",
            "completion",
        ),
        ({"completion": "a", "label": True}, "field 'prompt' is missing", "prompt"),
        ({"prompt": "q", "completion": "", "label": True}, "field 'completion' is empty", "completion"),
        (
            {"prompt": "q", "completion": ["a"], "label": True},
            "field 'completion' must be a string",
            "completion",
        ),
        (
            {"prompt": [], "completion": "a", "label": False},
            "field 'prompt' must be a non-empty list",
            "prompt",
        ),
        ({"prompt": "q", "completion": "a"}, "field 'label' is missing", "label"),
    ]
    for row, needle, field in cases:
        with pytest.raises(DatasetError) as err:
            parse_dataset(jsonl([first, row]))
        assert needle in str(err.value), (row, str(err.value))
        assert err.value.line == 2 and err.value.field == field
    with pytest.raises(DatasetError, match="kto rows cannot be used for dpo"):
        parse_dataset(jsonl([first]), kind="dpo")


def test_job_create_checks_and_type_defaults() -> None:
    def make(**kw: Any) -> JobCreate:
        return JobCreate.model_validate({"base_model": "m", "dataset": "f", **kw})

    kto = make(type="kto", lora={})
    hp = kto.hyperparameters
    assert (hp.learning_rate, hp.n_epochs, hp.beta) == (2e-4, 2, 0.1)
    assert make(type="simpo", lora={}).hyperparameters.beta == 2.0
    assert make(type="kto", lora={}, hyperparameters={"beta": 0.3, "n_epochs": 1}).hyperparameters.beta == 0.3
    assert make(type="sft", lora={}).hyperparameters.learning_rate == 1e-4
    for bad, needle in [
        ({"type": "kto", "hyperparameters": {"loss_type": "ipo"}}, "only applies to dpo jobs"),
        ({"type": "dpo", "hyperparameters": {"loss_type": "nope"}}, "loss_type"),
        ({"type": "dpo", "eval_fraction": 0.6}, "eval_fraction"),
        ({"type": "dpo", "eval_fraction": 0}, "eval_fraction"),
        ({"type": "dpo", "eval_fraction": 0.2, "eval_dataset": "g"}, "not both"),
        ({"type": "grpo", "reward": "gsm8k_exact_match", "eval_fraction": 0.2}, "eval_fraction applies"),
        ({"type": "kto", "hyperparameters": {"desirable_weight": 0}}, "desirable_weight"),
    ]:
        with pytest.raises(ValueError, match=needle):
            make(**bad)


def test_eval_split_is_seeded_and_keeps_prompts_whole() -> None:
    rows = [PromptRecord([{"role": "user", "content": f"q{i // 2}"}], None, i) for i in range(20)]
    train, held = split_eval(rows, 0.2, seed=3)
    assert split_eval(rows, 0.2, seed=3) == (train, held)
    assert len(held) == 4 and len(train) == 16
    held_prompts = {r.prompt[0]["content"] for r in held}
    assert not held_prompts & {r.prompt[0]["content"] for r in train}
    with pytest.raises(InvalidRequest, match="1 distinct prompt"):
        split_eval([PromptRecord([{"role": "user", "content": "same"}], None, 1)] * 5, 0.2, seed=0)


# ---- the prompt-group mask
def test_group_mask_generalises_the_shared_question_mask() -> None:
    shapes = [(3, (2, 4)), (2, (1, 1))]
    assert torch.equal(
        group_mask(shapes, 20), tandem_kernels.shared_question_mask([(3, 2, 4), (2, 1, 1)], total_len=20)
    )
    # three answers: the prompt is seen to the group's end, each answer only to its own end
    assert group_mask([(2, (2, 1, 2))], 8)[0, 0, :, 0].tolist() == [7, 7, 4, 4, 5, 7, 7, 8]


def test_kl_partners_are_a_rotation() -> None:
    partner = kl_partners(7, seed=1)
    assert sorted(partner) == list(range(7)) and all(partner[i] != i for i in range(7))
    assert kl_partners(1, seed=0) == [0]


# ---- packed == unpacked
@pytest.fixture(scope="module")
def fp32_models(tiny_model_path: Path) -> tuple:
    torch.manual_seed(0)
    return load_causal_lm(tiny_model_path), load_causal_lm(tiny_model_path, attn="sdpa")


@pytest.mark.parametrize(
    "kind,loss_type",
    [("dpo", "sigmoid"), ("dpo", "ipo"), ("dpo", "hinge"), ("simpo", "sigmoid"), ("orpo", "sigmoid")],
)
def test_packed_pair_losses_equal_unpacked(
    tiny_model_path: Path, hh_rows: bytes, fp32_models: tuple, kind: str, loss_type: str
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    recs = of_kind(parse_dataset(hh_rows).records[:8], PreferenceRecord)
    pairs = [tokenize_pair(tok, r.prompt, r.chosen, r.rejected) for r in recs]
    packed_model, plain_model = fp32_models
    plan = shuffled_bfd([len(p) for p in pairs], 2048, seed=0)
    assert any(len(p) > 1 for p in plan)
    hp = Hyperparameters(beta=0.5 if kind != "simpo" else 2.0, loss_type=loss_type)  # type: ignore[arg-type]
    lengths = answer_lengths(pairs)
    packed_model.zero_grad()
    packed_loss = 0.0
    ref = None
    for idx in plan:
        pc, pr = pack_pair_logps(
            packed_model, pack_pairs(pairs, idx, pad_id=tok.pad_token_id, pad_to_multiple_of=64)
        )
        if kind == "dpo":  # a fixed reference, as if from another model
            ref = torch.stack([pc.detach() - 0.5, pr.detach() + 0.25], dim=1)
        losses, _ = pair_losses(kind, hp, pc, pr, lengths[idx], ref)
        (losses.sum() / len(pairs)).backward()
        packed_loss += float(losses.sum().detach()) / len(pairs)
    plain_model.zero_grad()
    plain_loss = 0.0
    for i in range(len(pairs)):
        pc, pr = padded_pair_logps(plain_model, padded_pair_batch(pairs, [i], tok.pad_token_id))
        if kind == "dpo":
            ref = torch.stack([pc.detach() - 0.5, pr.detach() + 0.25], dim=1)
        losses, _ = pair_losses(kind, hp, pc, pr, lengths[[i]], ref)
        (losses.sum() / len(pairs)).backward()
        plain_loss += float(losses.sum().detach()) / len(pairs)
    assert abs(packed_loss - plain_loss) <= 1e-5, (packed_loss, plain_loss)
    plain_grads = dict(plain_model.named_parameters())
    worst = max(float((p.grad - plain_grads[n].grad).abs().max()) for n, p in packed_model.named_parameters())
    assert worst <= 1e-5, worst


def kto_records_from_pairs(hh_rows: bytes, n: int) -> list[KTORecord]:
    """Each HH pair as two KTO rows sharing the prompt (chosen desirable, rejected not)."""
    out = []
    for r in of_kind(parse_dataset(hh_rows).records[:n], PreferenceRecord):
        out.append(KTORecord(r.prompt, r.chosen, True, r.line))
        out.append(KTORecord(r.prompt, r.rejected, False, r.line))
    return out


def test_packed_kto_loss_and_grads_equal_unpacked(
    tiny_model_path: Path, hh_rows: bytes, fp32_models: tuple
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    data = KTOData(tok, kto_records_from_pairs(hh_rows, 6), seed=0, capacity=4096)
    assert len(data.groups) == 6 and all(len(g.answers) == 4 for g in data.groups)  # prompts shared
    packed_model, plain_model = fp32_models
    plan = shuffled_bfd([len(g) for g in data.groups], 4096, seed=0)
    assert any(len(p) > 1 for p in plan)
    rows = [data.rows_of(idx) for idx in plan]
    n = len(data.samples)

    def loss_of(pol: torch.Tensor, rows_: list[int]) -> torch.Tensor:
        ref = pol.detach() + torch.tensor([0.3, -0.2])  # a fixed reference (completion, KL)
        kl = kto_kl(pol[:, 1].detach(), ref[:, 1])
        losses, _ = kto_loss(pol[:, 0], ref[:, 0], data.labels[rows_], kl, 0.5, 1.2, 0.8)
        return losses.sum() / n

    packed_model.zero_grad()
    packed_loss = 0.0
    for idx, rs in zip(plan, rows, strict=True):
        pack = pack_groups(data.groups, idx, pad_id=tok.pad_token_id, pad_to_multiple_of=64)
        loss = loss_of(pack_answer_logps(packed_model, pack).view(-1, 2), rs)
        loss.backward()
        packed_loss += float(loss.detach())
    plain_model.zero_grad()
    plain_loss = 0.0
    for idx, rs in zip(plan, rows, strict=True):  # the same micro-batches (the KL is per micro-batch)
        seqs = [(data.groups[g].prompt, a) for g in idx for a in data.groups[g].answers]
        pol = torch.cat([padded_answer_logps(plain_model, [s], tok.pad_token_id) for s in seqs])
        loss = loss_of(pol.view(-1, 2), rs)
        loss.backward()
        plain_loss += float(loss.detach())
    assert abs(packed_loss - plain_loss) <= 1e-5, (packed_loss, plain_loss)
    plain_grads = dict(plain_model.named_parameters())
    worst = max(float((p.grad - plain_grads[n].grad).abs().max()) for n, p in packed_model.named_parameters())
    assert worst <= 1e-5, worst


# ---- the recipes learn
def yes_no_kto(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        rows.append({"prompt": f"Say yes {i}", "completion": "yes yes", "label": True})
        rows.append({"prompt": f"Say yes {i}", "completion": "no no no", "label": False})
    return rows


@pytest.mark.parametrize("packing", [True, False])
def test_kto_recipe_learns_and_reports_held_out_metrics(
    tiny_model_path: Path, tmp_path: Path, packing: bool
) -> None:
    records = parse_dataset(jsonl(yes_no_kto(20))).records
    train, held = split_eval(records, 0.2, seed=0)
    cfg = TrainConfig(
        kind="kto",
        model_path=tiny_model_path,
        records=train,
        eval_records=held,
        hp=Hyperparameters(learning_rate=5e-3, max_steps=10, n_epochs=10, beta=0.5, batch_size=8, seed=0),
        packing=packing,
        max_tokens_per_pack=256,
        pad_to_multiple_of=16,
        work_dir=tmp_path,
    )
    hooks = NullHooks()
    recipe = KTORecipe(cfg, hooks=hooks)
    assert run(recipe) == "succeeded"
    assert (tmp_path / "reference_logps.pt").is_file() and (tmp_path / "reference_logps_eval.pt").is_file()
    first, last = hooks.history[0], hooks.history[-1]
    assert first["loss"] == pytest.approx(0.5, abs=1e-3)  # policy == reference, KL 0: 1 - sigmoid(0)
    assert last["loss"] < first["loss"] - 0.1
    assert last["reward_accuracy"] > first["reward_accuracy"]
    before, after = hooks.evals["before"], hooks.evals["after"]
    assert (
        before["eval_loss_before"] == pytest.approx(0.5, abs=1e-3) and before["eval_accuracy_before"] == 0.0
    )
    assert after["eval_loss_after"] < after["eval_loss_before"] - 0.05
    assert after["eval_accuracy_after"] > 0.5 and after["eval_margin_after"] > 0
    assert recipe.last_metrics["eval_margin_after"] == after["eval_margin_after"]


@pytest.mark.parametrize("kind", ["simpo", "orpo", "dpo"])
def test_pair_recipes_learn_with_held_out_metrics(tiny_model_path: Path, kind: str) -> None:
    rows = [{"prompt": f"Say yes {i}", "chosen": "yes yes", "rejected": "no no no"} for i in range(20)]
    records = parse_dataset(jsonl(rows)).records
    train, held = split_eval(records, 0.2, seed=0)
    beta = {"simpo": 2.0, "orpo": 0.5, "dpo": 0.5}[kind]
    cfg = TrainConfig(
        kind=kind,
        model_path=tiny_model_path,
        records=train,
        eval_records=held,
        hp=Hyperparameters(
            learning_rate=5e-3,
            max_steps=8,
            n_epochs=8,
            beta=beta,
            seed=0,
            loss_type="ipo" if kind == "dpo" else "sigmoid",
        ),
        max_tokens_per_pack=256,
        pad_to_multiple_of=16,
    )
    hooks = NullHooks()
    assert run(DPORecipe(cfg, hooks=hooks)) == "succeeded"
    first, last = hooks.history[0], hooks.history[-1]
    assert last["loss"] < first["loss"]
    after = hooks.evals["after"]
    assert after["eval_loss_after"] < after["eval_loss_before"]
    assert after["eval_margin_after"] > after["eval_margin_before"]
    assert after["eval_accuracy_after"] == 1.0


def test_killed_kto_run_resumes_with_its_before_metrics_and_same_result(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    from tests.trainer.test_recipes import KillAt

    records = parse_dataset(jsonl(yes_no_kto(12))).records
    train, held = split_eval(records, 0.25, seed=0)

    def cfg(work: Path) -> TrainConfig:
        return TrainConfig(
            kind="kto",
            model_path=tiny_model_path,
            records=train,
            eval_records=held,
            hp=Hyperparameters(learning_rate=5e-3, max_steps=6, n_epochs=6, beta=0.5, seed=1),
            lora=LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
            max_tokens_per_pack=128,
            pad_to_multiple_of=16,
            checkpoint_every=2,
            work_dir=work,
        )

    straight = NullHooks()
    assert run(KTORecipe(cfg(tmp_path / "a"), hooks=straight), tmp_path / "a" / "ckpt") == "succeeded"
    with pytest.raises(KeyboardInterrupt):
        run(KTORecipe(cfg(tmp_path / "b"), hooks=KillAt(5)), tmp_path / "b" / "ckpt")
    resumed = NullHooks()
    assert run(KTORecipe(cfg(tmp_path / "b"), hooks=resumed), tmp_path / "b" / "ckpt") == "succeeded"
    assert [h["step"] for h in resumed.history] == [5, 6]
    assert "before" not in resumed.evals  # not recomputed on resume: it came from the checkpoint
    after, ref = resumed.evals["after"], straight.evals["after"]
    assert after["eval_loss_before"] == ref["eval_loss_before"]
    assert after["eval_loss_after"] == pytest.approx(ref["eval_loss_after"], abs=1e-5)
    assert resumed.history[-1]["loss"] == pytest.approx(straight.history[-1]["loss"], abs=1e-5)
