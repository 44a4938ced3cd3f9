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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from services.common.config import CommonSettings
from services.common.errors import InvalidRequest, NotFound
from services.common.paths import resolve_under_roots
from services.trainer.config import TrainerSettings
from services.trainer.data.formats import (
    ChatRecord,
    DatasetError,
    Kind,
    KTORecord,
    PreferenceRecord,
    PromptRecord,
    ReaderRecord,
    Record,
    of_kind,
    parse_dataset,
    records_for,
)
from services.trainer.protocol import READER_HELD_OUT, JobCreate

if TYPE_CHECKING:
    from services.trainer.data.pairs import EmbedderPair

KIND_OF: dict[str, Kind] = {
    "sft": "sft",
    "dpo": "dpo",
    "simpo": "dpo",
    "orpo": "dpo",
    "kto": "kto",
    "ppo": "rl",
    "grpo": "rl",
    "embedder": "embedder",
    "reader": "reader",
}
PAD_MULTIPLE = 64  # packs are padded to a multiple of this (kernel block friendly); counted as padding


def model_cache_root(common: CommonSettings) -> Path:
    return common.home_dir / "models" / "cache"


def resolve_base_model(
    name: str, common: CommonSettings, settings: TrainerSettings, owner: JobOwner | None = None
) -> Path:
    """The folder (or converted GGUF) a job named ``name`` trains from: a configured base
    model, a model under the allowed roots, or (see :func:`resolve_lineage`) one of the
    owner's fine-tunes. Another tenant's artifacts are refused as if they did not exist."""
    return resolve_lineage(name, common, settings, owner).model_path


@dataclass(frozen=True)
class JobOwner:
    """Who asks (the job's tenant) and where its jobs are recorded: lineage is checked
    against the trainer's own job store (jobs carry tenant and fine_tuned_model)."""

    tenant: str
    store: Any  # TrainerStore (not imported: the worker and the API both pass theirs)


@dataclass(frozen=True)
class Lineage:
    model_path: Path  # the weights the job loads
    init_adapter: Path | None = None  # a parent LoRA adapter the new one starts from
    parent_job: str | None = None  # the job whose fine-tune this one starts from
    parent_rank: int | None = None  # the parent adapter's rank (it fixes the new one's)


FT_NAME = re.compile(r"^ft-[0-9a-f]{1,64}$")


def _trainer_root(common: CommonSettings) -> Path:
    # where paths.artifact_dir puts every job's final weights
    return (common.home_dir / "models" / "trainer").resolve()


def _not_yours(name: str) -> NotFound:
    return NotFound(
        f"base_model {name!r}: no such model among the configured base models and your fine-tunes",
        param="base_model",
    )


def _own_job(name: str, job_id: str, owner: JobOwner | None) -> dict[str, str]:
    data: dict[str, str] = owner.store.job(job_id) if owner is not None else {}
    if not data or owner is None or data.get("tenant") != owner.tenant:
        raise _not_yours(name)
    if data.get("status") != "succeeded":
        raise InvalidRequest(
            f"base_model {name!r}: job {job_id} has not succeeded (status {data.get('status')!r})",
            param="base_model",
        )
    return data


def _lineage_of_job(name: str, job_id: str, data: dict[str, str], common: CommonSettings) -> Lineage:
    spec = json.loads(data["spec"])
    artifact = Path(data.get("artifact_path") or _trainer_root(common) / job_id)
    if not artifact.is_dir():
        raise InvalidRequest(f"base_model {name!r}: the weights of job {job_id} are gone", param="base_model")
    if spec.get("lora") is None:
        return Lineage(artifact, parent_job=job_id)
    # an adapter: train a new LoRA on the adapter's own base, starting from the adapter
    try:
        rank = json.loads((artifact / "adapter_config.json").read_text()).get("r")
    except (OSError, ValueError):
        rank = None
    return Lineage(Path(data["model_path"]), artifact, job_id, rank if isinstance(rank, int) else None)


def resolve_lineage(
    name: str,
    common: CommonSettings,
    settings: TrainerSettings,
    owner: JobOwner | None = None,
    spec: JobCreate | None = None,
) -> Lineage:
    """Like :func:`resolve_base_model`, and also what a job starting from a fine-tune needs.

    ``ft-<hex>`` names the fine-tune job ``ftjob-<hex>`` published (the names are made
    that way, see publish.published_name); a path under ``$TANDEM_HOME/models/trainer/``
    must be the final weights of one of the owner's jobs. Both must be the owner's: anything
    else is a 404 naming ``base_model`` that does not tell whether the model exists.
    """
    from services.inference.engine.loader import ModelNotFound, is_hf_folder, resolve_model

    named = [n.strip() for n in settings.base_models.split(",") if n.strip()]
    if name in named:
        try:
            return Lineage(resolve_model(name, model_cache_root(common)))
        except ModelNotFound as exc:
            raise InvalidRequest(f"base_model {name!r}: {exc}", param="base_model") from None
    if FT_NAME.match(name):
        job_id = "ftjob-" + name.removeprefix("ft-")
        data = _own_job(name, job_id, owner)
        if data.get("fine_tuned_model") != name:
            raise _not_yours(name)
        return _checked(_lineage_of_job(name, job_id, data, common), name, spec)
    looks_like_path = "/" in name or name.endswith(".gguf") or name.startswith(".")
    if not looks_like_path:
        raise InvalidRequest(
            f"unknown base_model {name!r}: use one of {', '.join(named) or '(none configured)'}, "
            "one of your fine-tunes (ft-...), "
            "or a Hugging Face folder / GGUF file under the allowed model roots",
            param="base_model",
        )
    path = resolve_under_roots(name, common.allowed_model_roots, param="base_model")
    trainer_root = _trainer_root(common)
    if path == trainer_root or path.is_relative_to(trainer_root):
        # the jobs' weights: only the final weights of the owner's own jobs
        parts = path.relative_to(trainer_root).parts
        if len(parts) != 1:
            raise _not_yours(name)
        data = _own_job(name, parts[0], owner)
        return _checked(_lineage_of_job(name, parts[0], data, common), name, spec)
    if is_hf_folder(path):
        return Lineage(path)
    if path.is_file() and path.suffix == ".gguf":
        return Lineage(resolve_model(path, model_cache_root(common)))
    raise InvalidRequest(
        f"unknown base_model {name!r}: {path} is neither a Hugging Face model folder (with config.json) nor a .gguf file",
        param="base_model",
    )


def check_own_artifact(value: str, common: CommonSettings, owner: JobOwner | None, param: str) -> None:
    """Any other path a job names (``reward.model``) may not reach into another tenant's
    job weights either."""
    path = resolve_under_roots(value, common.allowed_model_roots, param=param)
    trainer_root = _trainer_root(common)
    if path == trainer_root or path.is_relative_to(trainer_root):
        parts = path.relative_to(trainer_root).parts
        data = owner.store.job(parts[0]) if owner is not None and len(parts) == 1 else {}
        if not data or owner is None or data.get("tenant") != owner.tenant:
            raise NotFound(f"{param} {value!r}: no such model among your fine-tunes", param=param)


def _checked(lineage: Lineage, name: str, spec: JobCreate | None) -> Lineage:
    """A job from an adapter trains that adapter further: it must be a LoRA job of the same rank."""
    if lineage.init_adapter is None or spec is None:
        return lineage
    if spec.lora is None:
        raise InvalidRequest(
            f"base_model {name!r} is a LoRA adapter: a job from it trains the adapter further, so give 'lora'",
            param="lora",
        )
    if (
        "r" in spec.lora.model_fields_set
        and lineage.parent_rank is not None
        and spec.lora.r != lineage.parent_rank
    ):
        raise InvalidRequest(
            f"lora.r {spec.lora.r} differs from the rank {lineage.parent_rank} of base_model {name!r}, "
            "whose weights the new adapter starts from; leave lora.r out or give that rank",
            param="lora.r",
        )
    return lineage


def load_records(path: Path, kind: Kind, *, param: str = "dataset") -> list[Record]:
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


# the job types whose recipes train data-parallel under torchrun (``resources``)
DISTRIBUTED_TYPES = ("sft", "dpo", "simpo", "orpo", "kto")


def check_resources(spec: JobCreate, settings: TrainerSettings) -> None:
    """What the API can know about a distributed job before queueing it. The devices of the
    worker that will run it are only known there, so the launcher checks those (see launch.py)."""
    res = spec.resources
    if res is None:
        return
    if spec.type not in DISTRIBUTED_TYPES:
        # PPO/GRPO generate their rollouts on the inference service, one sampler for the job:
        # ranks would contend for it rather than split work, so they stay one process
        raise InvalidRequest(
            f"resources: a {spec.type} job cannot run distributed (its rollouts are generated on the "
            f"inference service, not split over ranks); distributed training runs "
            f"{', '.join(DISTRIBUTED_TYPES)} jobs (leave 'resources' out)",
            param="resources",
        )
    if res.nodes > settings.max_nodes:
        raise InvalidRequest(
            f"resources.nodes {res.nodes} is more than this server allows (TANDEM_TRAINER_MAX_NODES={settings.max_nodes})",
            param="resources.nodes",
        )
    if settings.max_procs_per_node and res.procs_per_node > settings.max_procs_per_node:
        raise InvalidRequest(
            f"resources.procs_per_node {res.procs_per_node} is more than the workers have "
            f"(TANDEM_TRAINER_MAX_PROCS_PER_NODE={settings.max_procs_per_node})",
            param="resources.procs_per_node",
        )


def check_lengths(tokenizer: Any, spec: JobCreate, records: list[Record], cap: int, param: str) -> None:
    """Every sample must fit in one pack (or, unpacked, in ``max_tokens_per_pack`` tokens)."""
    from services.trainer.data.tokenize import tokenize_kto, tokenize_pair, tokenize_prompt, tokenize_sft

    kind = KIND_OF[spec.type]
    if kind == "kto":
        # A row packs with its completion and another row's (KTO's mismatched KL completion):
        # the longest completion of the dataset bounds the latter.
        kto = of_kind(records, KTORecord)
        rows = [tokenize_kto(tokenizer, r.prompt, r.completion, r.label) for r in kto]
        longest = max((len(s.completion) for s in rows), default=0)
        for row, s in zip(kto, rows, strict=True):
            n = len(s.prompt) + len(s.completion) + longest
            if n > cap:
                raise InvalidRequest(
                    f"{param}: line {row.line} has {n} tokens (prompt + completion + the dataset's "
                    f"longest completion, its KL mismatch), more than max_tokens_per_pack={cap}; "
                    "raise max_tokens_per_pack or shorten the sample",
                    param="max_tokens_per_pack",
                )
        return
    for rec in records:
        if kind == "sft" and isinstance(rec, ChatRecord):
            n = len(tokenize_sft(tokenizer, rec.messages))
            what = "tokens"
        elif isinstance(rec, PreferenceRecord):
            n = len(tokenize_pair(tokenizer, rec.prompt, rec.chosen, rec.rejected))
            what = "tokens (prompt + chosen + rejected)"
        elif isinstance(rec, PromptRecord):
            n = len(tokenize_prompt(tokenizer, rec.prompt)) + spec.hyperparameters.max_new_tokens
            what = "tokens (prompt + max_new_tokens)"
        else:
            raise TypeError(f"{kind} jobs have no {type(rec).__name__} samples")
        if n > cap:
            raise InvalidRequest(
                f"{param}: line {rec.line} has {n} {what}, more than max_tokens_per_pack={cap}; "
                "raise max_tokens_per_pack or shorten the sample",
                param="max_tokens_per_pack",
            )


def prompt_key(rec: Record | EmbedderPair) -> str:
    if isinstance(rec, PromptRecord | PreferenceRecord | KTORecord):
        return json.dumps(rec.prompt, sort_keys=True)
    # an embedder pair's query plays the prompt: a held-out query is never trained on
    assert isinstance(rec, dict), rec
    return json.dumps(rec["query"], sort_keys=True)


T = TypeVar("T", bound="Record | EmbedderPair")


def split_eval(records: list[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
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
    # the kind's records (data/formats.py); an embedder job's pairs (data/pairs.py)
    records: list[Any]
    eval_records: list[Any] | None
    capacity: int
    reward: Any
    lineage: Lineage | None = None
    corpus: dict[str, str] | None = None  # embedder jobs: what held-out queries are ranked against


def resolve_embedder_base(name: str, common: CommonSettings, owner: JobOwner | None) -> Path:
    """The sentence-transformers folder an embedder job starts from: all-MiniLM-L6-v2 (the
    packaged one), one of the owner's published embedders (``ft-emb-...``), or a folder under
    the allowed model roots that is neither another tenant's embedder nor its job weights."""
    from services.common.embedders import find_embedder, is_embedder_name
    from services.common.embedding_models import DEFAULT_ALIASES, resolve_model_path

    if is_embedder_name(name):
        hit = find_embedder(common.home_dir, owner.tenant, name) if owner is not None else None
        if hit is None:
            raise NotFound(f"base_model {name!r}: no such embedder among yours", param="base_model")
        return hit[0]
    if name in DEFAULT_ALIASES:
        return resolve_model_path(name, common.allowed_model_roots, param="base_model")
    check_own_artifact(name, common, owner, "base_model")
    path = resolve_under_roots(name, common.allowed_model_roots, param="base_model")
    check_published_path(path, name, common, owner)
    return resolve_model_path(str(path), common.allowed_model_roots, param="base_model")


def check_published_path(path: Path, name: str, common: CommonSettings, owner: JobOwner | None) -> None:
    """A job may start from a published embedder or reader by its folder only when it may use it
    by name: the owner's own, or a shared reader. Another tenant's is a 404, as if missing."""
    from services.common.embedders import embedders_root
    from services.common.readers import SHARED, readers_root

    home = common.home_dir
    for root, what, shared in (
        (embedders_root(home), "embedder", None),
        (readers_root(home), "reader", SHARED),
    ):
        root = root.resolve()
        if not path.is_relative_to(root):
            continue
        parts = path.relative_to(root).parts
        if owner is None or not parts or parts[0] not in (owner.tenant, shared):
            raise NotFound(f"base_model {name!r}: no such {what} among yours", param="base_model")


def resolve_reader_base(name: str, common: CommonSettings, owner: JobOwner | None) -> Path:
    """The model a reader job starts from: all-MiniLM-L6-v2 (the packaged bi-encoder: the
    cross-encoder's classification head starts new), one of the owner's or the shared published
    readers (``ft-reader-...``, or a shared one's name such as ``tandem-reader``: trained further), one of the owner's published embedders
    (``ft-emb-...``, a new head too), or a sentence-transformers / Hugging Face
    BERT-like folder under the allowed model roots (neither another tenant's published models
    nor its job weights). Anything else is a 404 naming ``base_model``."""
    from services.common.embedders import is_embedder_name
    from services.common.embedding_models import DEFAULT_ALIASES, resolve_model_path
    from services.common.readers import find_reader, is_reader_name

    hit = find_reader(common.home_dir, owner.tenant, name) if owner is not None else None
    if hit is not None:  # a published reader, whatever its name (the shared tandem-reader too)
        return hit[0]
    if is_reader_name(name):
        raise NotFound(
            f"base_model {name!r}: no such reader among yours and the shared ones", param="base_model"
        )
    if is_embedder_name(name):  # the tenant's fine-tuned bi-encoder: a new head on its encoder
        return resolve_embedder_base(name, common, owner)
    if name in DEFAULT_ALIASES:
        return resolve_model_path(name, common.allowed_model_roots, param="base_model")
    check_own_artifact(name, common, owner, "base_model")
    path = resolve_under_roots(name, common.allowed_model_roots, param="base_model")
    check_published_path(path, name, common, owner)
    if not (path / "config.json").is_file():
        raise NotFound(
            f"base_model {name!r}: no such model: give all-MiniLM-L6-v2, one of your readers "
            "(ft-reader-...), or a model folder (with config.json) under the allowed model roots",
            param="base_model",
        )
    return path


def reader_unit(rec: ReaderRecord, by_group: bool) -> str:
    """What a reader job holds out whole: the row's group (a document set) when the rows have
    several, else its question (all of a question's candidates stay on one side)."""
    return f"group:{rec.group or ''}" if by_group else f"question:{rec.question}"


def split_reader(
    records: list[ReaderRecord], fraction: float, seed: int
) -> tuple[list[ReaderRecord], list[ReaderRecord]]:
    """A seeded held-out split of a reader dataset: ``fraction`` of its groups (at least one)
    when the rows name several groups (rows without one form a group of their own), else
    ``fraction`` of its questions; the held-out questions and documents are never trained on."""
    by_group = len({r.group for r in records}) > 1
    units = sorted({reader_unit(r, by_group) for r in records})
    random.Random(seed).shuffle(units)
    held = set(units[: max(1, round(fraction * len(units)))])
    if len(held) >= len(units):
        what = "groups" if by_group else "questions (and no 'group' to hold out)"
        raise InvalidRequest(
            f"eval_fraction {fraction}: the dataset has {len(units)} distinct {what}, too few to hold "
            "some out and still train",
            param="eval_fraction",
        )
    train = [r for r in records if reader_unit(r, by_group) not in held]
    return train, [r for r in records if reader_unit(r, by_group) in held]


def check_labels(records: list[ReaderRecord], param: str, what: str = "rows") -> None:
    """A reader learns to tell answering sentences (label 1) from the others (label 0): its
    training rows must hold both."""
    labels = {r.label for r in records}
    if labels != {0, 1}:
        has = f"all {len(records)} {what} have label {labels.pop()}" if labels else f"no {what}"
        raise InvalidRequest(
            f"{param}: {has}; a reader job needs sentences that answer their question (label 1) and "
            "sentences that do not (label 0)",
            param=param,
        )


def validate_reader_job(
    spec: JobCreate,
    dataset_path: Path,
    eval_path: Path | None,
    common: CommonSettings,
    owner: JobOwner | None,
) -> ResolvedJob:
    """A reader job's training and held-out rows and its base model, checked."""
    if spec.resources is not None:
        raise InvalidRequest(
            "resources: reader jobs run in one process (a small cross-encoder trains on one device); "
            "leave 'resources' out",
            param="resources",
        )
    records = of_kind(load_records(dataset_path, "reader"), ReaderRecord)
    check_labels(records, "dataset")
    if eval_path is not None:
        held = of_kind(load_records(eval_path, "reader", param="eval_dataset"), ReaderRecord)
    else:
        fraction = spec.eval_fraction or READER_HELD_OUT
        records, held = split_reader(records, fraction, spec.hyperparameters.seed)
        check_labels(records, "dataset", "rows left to train after holding out eval_fraction")
    if spec.reader_kind == "features":
        check_features(records, "dataset")
        check_features(held, "eval_dataset" if eval_path is not None else "dataset", like=records[0])
        # no model to start from: the features' model starts new
        return ResolvedJob(Path(spec.base_model), list(records), list(held), 0, None)
    model_path = resolve_reader_base(spec.base_model, common, owner)
    check_reader_base_kind(spec, model_path)
    return ResolvedJob(model_path, list(records), list(held), 0, None)


def check_reader_base_kind(spec: JobCreate, model_path: Path) -> None:
    """A published reader goes on training as what it is: a bi-encoder job cannot start from a
    cross-encoder reader (its head scores pairs, it has no sentence vectors), nor the reverse."""
    from services.common.readers import MANIFEST, ReaderManifest

    manifest = model_path / MANIFEST
    if not manifest.is_file():
        return
    kind = ReaderManifest.model_validate_json(manifest.read_text()).kind
    if kind != spec.reader_kind:
        raise InvalidRequest(
            f"base_model {spec.base_model!r} is a {kind} reader; a {spec.reader_kind!r} reader job "
            f"cannot start from it (start from all-MiniLM-L6-v2 or a {spec.reader_kind} reader)",
            param="base_model",
        )


def check_features(records: list[ReaderRecord], param: str, like: ReaderRecord | None = None) -> None:
    """A features reader's rows all carry the same feature names (its model's inputs)."""
    names = None if like is None else list(like.features or {})
    for r in records:
        if r.features is None:
            raise InvalidRequest(
                f"{param}: line {r.line} has no 'features'; a 'features' reader job reads them on every row",
                param=param,
            )
        if names is None:
            names = list(r.features)
        elif list(r.features) != names:
            raise InvalidRequest(
                f"{param}: line {r.line}'s features differ from the first row's ({len(r.features)} names "
                f"against {len(names)}); every row needs the same names in the same order",
                param=param,
            )


def _embedder_dim(path: Path) -> int | None:
    """The embedding size a model folder declares (its pooling, else its hidden size)."""
    for f, key in (
        (path / "1_Pooling" / "config.json", "word_embedding_dimension"),
        (path / "config.json", "hidden_size"),
    ):
        try:
            value = json.loads(f.read_text()).get(key)
        except (OSError, ValueError):
            continue
        if isinstance(value, int):
            return value
    return None


def embedder_corpus(path: Path) -> dict[str, str]:
    """A beir file's documents (corpus id -> title and text); none for a pairs file."""
    from services.trainer.data.pairs import embedder_data

    return embedder_data(load_records(path, "embedder")).corpus


def held_out_from(labelled: list[EmbedderPair], titles: list[EmbedderPair], apply: bool) -> str:
    """Which pairs an embedder job holds out: its labelled pairs, or the collection's titles and
    headings when it has none. A job that applies its embedder scores the held-out queries on
    the collection, so they must name the documents they should find: labelled pairs that name
    none leave the titles as the yardstick, and a job with neither is refused."""
    from services.trainer.data.pairs import relevant_document

    if labelled and (not apply or any(relevant_document(p) for p in labelled)):
        return "labelled pairs"
    if titles and (not apply or any(relevant_document(p) for p in titles)):
        return "titles and headings"
    if not apply:
        return "labelled pairs"
    raise InvalidRequest(
        "apply: no held-out yardstick: the job's pairs name no documents of the collection (give pairs "
        "with 'document_id', or beir rows) and the collection has no titles or headings to hold out; "
        "leave 'apply' out, or give such pairs",
        param="apply",
    )


def validate_embedder_job(
    spec: JobCreate,
    dataset_path: Path | None,
    eval_path: Path | None,
    common: CommonSettings,
    owner: JobOwner | None,
    collection_path: Path | None = None,
    generated_path: Path | None = None,
    *,
    questions_pending: bool = False,
) -> ResolvedJob:
    """An embedder job's pairs (its file, its collection's snapshot, its generated questions,
    or several), held-out pairs and corpus, and base model. ``questions_pending``: the job's
    generated questions are still to be written (at submission), so it may have no pairs yet
    (the worker checks again with them)."""
    from services.trainer.data.pairs import LABELLED_STAGE, TITLE_STAGE, EmbedderData, embedder_data

    if spec.resources is not None:
        raise InvalidRequest(
            "resources: embedder jobs run in one process (a sentence-transformers encoder trains in minutes "
            "on one device); leave 'resources' out",
            param="resources",
        )
    parts: list[EmbedderData] = []
    labelled: list[EmbedderPair] = []  # the file's and the generated pairs
    titles: list[EmbedderPair] = []  # the collection's title and heading pairs
    for path, param in (
        (dataset_path, "dataset"),
        (collection_path, "collection"),
        (generated_path, "generate_queries"),
    ):
        if path is not None:
            part = embedder_data(load_records(path, "embedder", param=param))
            parts.append(part)
            for p in part.pairs:
                # a collection's snapshot (the dataset of a job from a collection alone, too)
                if param == "collection" or p.get("title_of") is not None:
                    titles.append({**p, "_stage": TITLE_STAGE})
                else:
                    labelled.append({**p, "_stage": LABELLED_STAGE})
    corpus = {cid: text for part in parts for cid, text in part.corpus.items()}
    eval_records = None
    if eval_path is not None:
        held = embedder_data(load_records(eval_path, "embedder", param="eval_dataset"))
        eval_records = held.pairs
        corpus.update(held.corpus)
    elif spec.eval_fraction is not None and (labelled or titles or not questions_pending):
        # held out from what the job is judged on: the labelled pairs, or the titles without them
        if held_out_from(labelled, titles, spec.apply) == "labelled pairs":
            labelled, eval_records = split_eval(labelled, spec.eval_fraction, spec.hyperparameters.seed)
        else:
            titles, eval_records = split_eval(titles, spec.eval_fraction, spec.hyperparameters.seed)
    pairs = titles + labelled
    if not pairs and not questions_pending:
        raise InvalidRequest("dataset: no training pairs (no qrel with a score above 0)", param="dataset")
    model_path = resolve_embedder_base(spec.base_model, common, owner)
    dims = spec.hyperparameters.matryoshka_dims
    dim = _embedder_dim(model_path)
    if dims and dim is not None and max(dims) > dim:
        raise InvalidRequest(
            f"hyperparameters.matryoshka_dims {dims}: {max(dims)} is more than the model's {dim} dimensions",
            param="hyperparameters.matryoshka_dims",
        )
    return ResolvedJob(model_path, pairs, eval_records, 0, None, corpus=corpus)


def validate_job(
    spec: JobCreate,
    dataset_path: Path,
    eval_path: Path | None,
    common: CommonSettings,
    settings: TrainerSettings,
    owner: JobOwner | None = None,
) -> ResolvedJob:
    if spec.type == "reader":
        return validate_reader_job(spec, dataset_path, eval_path, common, owner)
    from transformers import AutoTokenizer

    from services.trainer.modeling import ModelError, check_lora_targets

    kind = KIND_OF[spec.type]
    cap = pack_capacity(spec, settings)
    check_resources(spec, settings)
    records = load_records(dataset_path, kind)
    eval_records = load_records(eval_path, kind, param="eval_dataset") if eval_path else None
    if spec.eval_fraction is not None:
        records, eval_records = split_eval(records, spec.eval_fraction, spec.hyperparameters.seed)
    reward = resolve_reward(spec, common)
    lineage = resolve_lineage(spec.base_model, common, settings, owner, spec)
    model_path = lineage.model_path
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
    return ResolvedJob(model_path, records, eval_records, cap, reward, lineage)
