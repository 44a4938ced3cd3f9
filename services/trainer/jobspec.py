"""Turning a job request into what a recipe runs on, checking everything on the way.

The API calls :func:`validate_job` before it queues anything, so bad input (an
unknown base model, a LoRA target the model lacks, a sample longer than the pack, a
dataset of the wrong kind, an unknown reward) is refused with a 400 naming the
value, and never ties up a worker. The worker calls the same functions again to
build its :class:`TrainConfig` (the files could have changed in between).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.config import CommonSettings
from services.common.errors import InvalidRequest
from services.common.paths import resolve_under_roots
from services.trainer.config import TrainerSettings
from services.trainer.data.formats import DatasetError, Kind, parse_dataset, records_for
from services.trainer.protocol import JobCreate

KIND_OF: dict[str, Kind] = {
    "sft": "sft",
    "dpo": "dpo",
    "simpo": "dpo",
    "orpo": "dpo",
    "kto": "kto",
    "ppo": "rl",
    "grpo": "rl",
}
PAD_MULTIPLE = 64  # packs are padded to a multiple of this (kernel block friendly); counted as padding


def model_cache_root(common: CommonSettings) -> Path:
    return common.home_dir / "models" / "cache"


def resolve_base_model(name: str, common: CommonSettings, settings: TrainerSettings) -> Path:
    from services.inference.engine.loader import ModelNotFound, is_hf_folder, resolve_model

    named = [n.strip() for n in settings.base_models.split(",") if n.strip()]
    if name in named:
        try:
            return resolve_model(name, model_cache_root(common))
        except ModelNotFound as exc:
            raise InvalidRequest(f"base_model {name!r}: {exc}", param="base_model") from None
    looks_like_path = "/" in name or name.endswith(".gguf") or name.startswith(".")
    if not looks_like_path:
        raise InvalidRequest(
            f"unknown base_model {name!r}: use one of {', '.join(named) or '(none configured)'} "
            "or a Hugging Face folder / GGUF file under the allowed model roots",
            param="base_model",
        )
    path = resolve_under_roots(name, common.allowed_model_roots, param="base_model")
    if is_hf_folder(path):
        return path
    if path.is_file() and path.suffix == ".gguf":
        return resolve_model(path, model_cache_root(common))
    raise InvalidRequest(
        f"unknown base_model {name!r}: {path} is neither a Hugging Face model folder (with config.json) nor a .gguf file",
        param="base_model",
    )


def load_records(path: Path, kind: Kind, *, param: str = "dataset") -> list[dict[str, Any]]:
    try:
        return records_for(parse_dataset(path.read_bytes()), kind)
    except DatasetError as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from None


def resolve_reward(spec: JobCreate, common: CommonSettings) -> Any:
    from services.trainer import rewards

    if spec.reward is None:
        return None
    if spec.reward.function is not None:
        try:
            return rewards.get_reward(spec.reward.function)
        except KeyError as exc:
            raise InvalidRequest(str(exc.args[0]), param="reward") from None
    assert spec.reward.model is not None
    path = resolve_under_roots(spec.reward.model, common.allowed_model_roots, param="reward.model")
    if not (path / "config.json").is_file():
        raise InvalidRequest(
            f"reward.model {spec.reward.model!r} is not a model folder (no config.json)", param="reward.model"
        )
    return path


def pack_capacity(spec: JobCreate, settings: TrainerSettings) -> int:
    cap = spec.max_tokens_per_pack or settings.default_max_tokens_per_pack
    if cap > settings.max_tokens_per_pack_limit:
        raise InvalidRequest(
            f"max_tokens_per_pack {cap} is above this server's limit {settings.max_tokens_per_pack_limit}",
            param="max_tokens_per_pack",
        )
    return cap


def check_lengths(
    tokenizer: Any, spec: JobCreate, records: list[dict[str, Any]], cap: int, param: str
) -> None:
    """Every sample must fit in one pack (or, unpacked, in ``max_tokens_per_pack`` tokens)."""
    from services.trainer.data.tokenize import tokenize_kto, tokenize_pair, tokenize_prompt, tokenize_sft

    kind = KIND_OF[spec.type]
    if kind == "kto":
        # A row packs with its completion and another row's (KTO's mismatched KL completion):
        # the longest completion of the dataset bounds the latter.
        rows = [tokenize_kto(tokenizer, r["prompt"], r["completion"], r["label"]) for r in records]
        longest = max((len(s.completion) for s in rows), default=0)
        for rec, s in zip(records, rows, strict=True):
            n = len(s.prompt) + len(s.completion) + longest
            if n > cap:
                raise InvalidRequest(
                    f"{param}: line {rec.get('_line', '?')} has {n} tokens (prompt + completion + the dataset's "
                    f"longest completion, its KL mismatch), more than max_tokens_per_pack={cap}; "
                    "raise max_tokens_per_pack or shorten the sample",
                    param="max_tokens_per_pack",
                )
        return
    for rec in records:
        if kind == "sft":
            n = len(tokenize_sft(tokenizer, rec["messages"]))
            what = "tokens"
        elif kind == "dpo":
            n = len(tokenize_pair(tokenizer, rec["prompt"], rec["chosen"], rec["rejected"]))
            what = "tokens (prompt + chosen + rejected)"
        else:
            n = len(tokenize_prompt(tokenizer, rec["prompt"])) + spec.hyperparameters.max_new_tokens
            what = "tokens (prompt + max_new_tokens)"
        if n > cap:
            raise InvalidRequest(
                f"{param}: line {rec.get('_line', '?')} has {n} {what}, more than max_tokens_per_pack={cap}; "
                "raise max_tokens_per_pack or shorten the sample",
                param="max_tokens_per_pack",
            )


def prompt_key(rec: dict[str, Any]) -> str:
    return json.dumps(rec.get("prompt", rec.get("messages")), sort_keys=True)


def split_eval(
    records: list[dict[str, Any]], fraction: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A seeded held-out split of about ``fraction`` of the rows (at least one), whole
    prompts at a time: rows sharing a prompt (a KTO prompt's good and bad answers, DPO
    drafts) land on the same side, so the held-out prompts were never trained on."""
    by_prompt: dict[str, list[int]] = {}
    for i, rec in enumerate(records):
        by_prompt.setdefault(prompt_key(rec), []).append(i)
    groups = list(by_prompt.values())
    random.Random(seed).shuffle(groups)
    target = max(1, round(fraction * len(records)))
    held: set[int] = set()
    for g in groups:
        if len(held) >= target:
            break
        held.update(g)
    if len(held) >= len(records):
        raise InvalidRequest(
            f"eval_fraction {fraction}: the dataset's {len(records)} rows have {len(groups)} distinct prompt(s), "
            "too few to hold some out and still train (held-out rows keep their whole prompt)",
            param="eval_fraction",
        )
    train = [r for i, r in enumerate(records) if i not in held]
    return train, [records[i] for i in sorted(held)]


@dataclass
class ResolvedJob:
    model_path: Path
    records: list[dict[str, Any]]
    eval_records: list[dict[str, Any]] | None
    capacity: int
    reward: Any


def validate_job(
    spec: JobCreate,
    dataset_path: Path,
    eval_path: Path | None,
    common: CommonSettings,
    settings: TrainerSettings,
) -> ResolvedJob:
    from transformers import AutoTokenizer

    from services.trainer.modeling import ModelError, check_lora_targets

    kind = KIND_OF[spec.type]
    cap = pack_capacity(spec, settings)
    records = load_records(dataset_path, kind)
    eval_records = load_records(eval_path, kind, param="eval_dataset") if eval_path else None
    if spec.eval_fraction is not None:
        records, eval_records = split_eval(records, spec.eval_fraction, spec.hyperparameters.seed)
    reward = resolve_reward(spec, common)
    model_path = resolve_base_model(spec.base_model, common, settings)
    if spec.lora is not None:
        try:
            check_lora_targets(model_path, spec.lora.target_modules)
        except ModelError as exc:
            raise InvalidRequest(str(exc), param="lora.target_modules") from None
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest(f"base_model {spec.base_model!r} has no chat template", param="base_model")
    try:
        check_lengths(tokenizer, spec, records, cap, "dataset")
        if eval_records:
            check_lengths(tokenizer, spec, eval_records, cap, "eval_dataset")
    except DatasetError as exc:
        raise InvalidRequest(f"dataset: {exc}", param="dataset") from None
    return ResolvedJob(model_path, records, eval_records, cap, reward)
