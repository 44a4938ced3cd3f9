"""Wire models of the trainer API (``/v1/files``, ``/v1/jobs``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.common.bounds import NAME_CHARS

# Re-exported: the trainer's modules import them from here.
from services.common.jobs import TERMINAL as TERMINAL
from services.common.jobs import JobStatus as JobStatus

JobType = Literal["sft", "dpo", "simpo", "orpo", "kto", "ppo", "grpo", "embedder", "reader"]
EmbedderLoss = Literal["mnrl", "cached_mnrl"]
NegativesFrom = Literal["model", "collection"]
EmbedderPrecision = Literal["auto", "fp32", "bf16"]
PositivesAs = Literal["documents", "chunks"]
DpoLossType = Literal["sigmoid", "ipo", "hinge"]
PREFERENCE_TYPES: tuple[str, ...] = ("dpo", "simpo", "orpo", "kto")  # jobs with held-out accuracy/margin


# A model path or file id (a folder under the allowed model roots can be long).
PATH_CHARS = 4096


class Strict(BaseModel):
    # strict: a boolean is not a number (``"r": true`` is not rank 1) nor a number a boolean;
    # an integer is still a float
    model_config = ConfigDict(extra="forbid", strict=True)


class LoraSpec(Strict):
    r: int = Field(8, ge=1, le=1024, description="LoRA rank")
    alpha: float = Field(16.0, gt=0, le=4096, description="LoRA scaling numerator (alpha / r)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[Annotated[str, Field(max_length=NAME_CHARS)]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        max_length=256,
        description="Names (last component) of the linear layers to adapt",
    )


class Hyperparameters(Strict):
    """Every knob a recipe reads; ranges refuse values that cannot train."""

    learning_rate: float | None = Field(
        None, gt=0, le=1.0, description="default per job type and LoRA/full (services/trainer/defaults.py)"
    )
    n_epochs: int = Field(1, ge=1, le=100, description="default per job type (services/trainer/defaults.py)")
    max_steps: int | None = Field(None, ge=1, le=1_000_000, description="cap on optimizer steps")
    batch_size: int = Field(8, ge=1, le=4096, description="samples (or pairs) per step without packing")
    packs_per_step: int = Field(1, ge=1, le=1024, description="packs per optimizer step with packing")
    warmup_steps: int = Field(0, ge=0, le=1_000_000)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "linear"
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    max_grad_norm: float = Field(1.0, ge=0.0, le=1e4, description="0 disables clipping")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    checkpoint_every: int | None = Field(None, ge=1, le=1_000_000)
    gradient_checkpointing: bool = False
    # DPO family and KTO (beta's default depends on the job type: services/trainer/defaults.py)
    beta: float = Field(
        0.1, gt=0.0, le=10.0, description="DPO/KTO/SimPO temperature; ORPO's lambda (TRL's naming)"
    )
    loss_type: DpoLossType = Field("sigmoid", description="dpo jobs only: sigmoid (DPO), ipo or hinge")
    simpo_gamma: float = Field(0.5, ge=0.0, le=10.0, description="SimPO's target reward margin gamma")
    desirable_weight: float | None = Field(
        None, gt=0.0, le=100.0, description="KTO: weight of desirable rows; default: balanced to the counts"
    )
    undesirable_weight: float | None = Field(
        None, gt=0.0, le=100.0, description="KTO: weight of undesirable rows; default: balanced to the counts"
    )
    # PPO / GRPO
    prompts_per_step: int = Field(4, ge=1, le=1024)
    group_size: int = Field(4, ge=2, le=64, description="GRPO completions per prompt")
    max_new_tokens: int = Field(64, ge=1, le=8192)
    temperature: float = Field(1.0, gt=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    kl_coef: float = Field(0.05, ge=0.0, le=10.0)
    clip_range: float = Field(0.2, gt=0.0, le=1.0)
    vf_coef: float = Field(0.5, ge=0.0, le=10.0)
    gamma: float = Field(1.0, gt=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    ppo_epochs: int = Field(1, ge=1, le=16)
    # embedder jobs (sentence-transformers losses; batch_size is the in-batch negatives' pool)
    loss: EmbedderLoss = Field(
        "mnrl",
        description="embedder jobs: mnrl (MultipleNegativesRankingLoss) or cached_mnrl (its GradCache "
        "variant: large batches in mini_batch_size pieces of memory)",
    )
    mini_batch_size: int = Field(32, ge=1, le=4096, description="embedder jobs with loss cached_mnrl")
    matryoshka_dims: list[Annotated[int, Field(ge=1, le=65536)]] | None = Field(
        None,
        min_length=1,
        max_length=16,
        description="embedder jobs: also train these truncated dimensions (MatryoshkaLoss), e.g. [384, 128, 64]",
    )
    max_seq_length: int | None = Field(
        None,
        ge=8,
        le=8192,
        description="embedder jobs: tokens read per text (default: the model's own); reader jobs: tokens "
        "of a question and passage together (default 160)",
    )
    hard_negatives: int = Field(
        0,
        ge=0,
        le=32,
        description="embedder jobs: negatives mined per pair with the base model over the job's corpus "
        "(sentence-transformers' mine_hard_negatives: the texts nearest the query that are not its "
        "positives); 0: in-batch negatives only",
    )
    hard_negatives_margin: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="embedder jobs with hard_negatives: a candidate scoring above the query's positive "
        "less this share of it is skipped as a likely unlabelled positive (relative_margin)",
    )
    hard_negatives_skip: int = Field(
        0,
        ge=0,
        le=1000,
        description="embedder jobs with hard_negatives: also skip this many of the nearest candidates (range_min)",
    )
    precision: EmbedderPrecision = Field(
        "auto",
        description="embedder jobs: the matrix products of training (autocast; weights and optimizer "
        "stay fp32): bf16, fp32, or auto (an accelerator's default dtype, fp32 on a CPU: bf16 trained "
        "SciFact's labelled pairs only 5% faster on an AMX CPU)",
    )
    hard_negatives_from: NegativesFrom = Field(
        "model",
        description="embedder jobs with hard_negatives: 'model' mines with the base model over the job's "
        "corpus; 'collection' (needs the job's 'collection') takes them from the collection's own hybrid "
        "search as it ranks today: each training query's documents from rank hard_negatives_skip on that "
        "are not its labelled positives, each as its best-ranked chunk (hard_negatives_margin does not "
        "apply)",
    )

    title_epochs: int = Field(
        1,
        ge=1,
        le=100,
        description="embedder jobs with stages 'titles_first': epochs of the first stage, the collection's "
        "title and heading pairs (n_epochs is the second stage's, the labelled pairs')",
    )
    title_documents: int = Field(
        2000,
        ge=1,
        le=1_000_000,
        description="embedder jobs with a 'collection': documents (a seeded sample) whose title and "
        "heading pairs train",
    )

    @field_validator("matryoshka_dims")
    @classmethod
    def _dims(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(d < 1 for d in value):
            raise ValueError("matryoshka_dims must be positive dimensions")
        return value


class RewardSpec(Strict):
    function: str | None = Field(
        None, max_length=NAME_CHARS, description="name of a registered reward function"
    )
    model: str | None = Field(
        None, max_length=PATH_CHARS, description="reward-model folder under the allowed model roots"
    )

    @model_validator(mode="after")
    def _one(self) -> RewardSpec:
        if (self.function is None) == (self.model is None):
            raise ValueError("give exactly one of 'function' or 'model'")
        return self


class ResourcesSpec(Strict):
    """Data-parallel training over ``nodes`` machines x ``procs_per_node`` processes, launched
    with torchrun (c10d rendezvous); every rank packs and trains on its share of each step."""

    nodes: int = Field(
        1, ge=1, le=1024, description="machines (workers of the job's queue) that train together"
    )
    procs_per_node: int = Field(
        1, ge=1, le=1024, description="processes per machine: at most its GPUs (cuda) or CPU cores (cpu)"
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: replicated weights, all-reduced gradients; fsdp: FSDP2 fully_shard"
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class QueryGeneration(Strict):
    """Embedder jobs: label-free pairs of passages sampled from the job's corpus (its collection's
    documents and its beir file's corpus, cut as the retrieval service chunks them) and the one
    short question a chat model of the inference service writes for each."""

    model: str = Field(
        min_length=1,
        max_length=NAME_CHARS,
        description="a chat model the inference service serves to the caller",
    )
    passages: int = Field(
        200, ge=1, le=100_000, description="passages sampled (seeded by hyperparameters.seed)"
    )
    max_tokens: int = Field(48, ge=4, le=512, description="tokens a question may take")
    temperature: float = Field(
        0.7,
        ge=0.0,
        le=2.0,
        description="sampling temperature (each passage seeded: the same job writes the same)",
    )


# Reader jobs hold out a fifth of their groups (or of their questions) unless told otherwise: the
# held-out rows choose the reader's threshold, so a reader job always has some.
READER_HELD_OUT = 0.2
# The reader's base when a reader job names none: the offline all-MiniLM-L6-v2 (a bi-encoder:
# its classification head starts new)
READER_BASE = "all-MiniLM-L6-v2"


def recipe_kind(job_type: str, reader_kind: str) -> str:
    """The recipe (and its defaults) a job runs: a reader job's kind picks among the readers."""
    if job_type != "reader" or reader_kind == "cross-encoder":
        return job_type
    return f"reader-{'bi' if reader_kind == 'bi-encoder' else reader_kind}"


# The share of an applying job's pairs held out as its yardstick: on SciFact (173 pairs) 0.1 gave
# held-out hybrid nDCG@10 0.7353 and 0.2 gave 0.7344 (fewer pairs train); see defaults.py.
APPLY_HELD_OUT = 0.1

EMBEDDER_ONLY = (
    "loss",
    "mini_batch_size",
    "matryoshka_dims",
    "max_seq_length",
    "hard_negatives",
    "hard_negatives_margin",
    "hard_negatives_skip",
    "hard_negatives_from",
    "precision",
    "title_epochs",
    "title_documents",
)
# embedder-only hyperparameters a reader job reads too
READER_ALSO = ("max_seq_length",)
Stages = Literal["titles_first", "together"]


class JobCreate(Strict):
    type: JobType
    base_model: str = Field(min_length=1, max_length=PATH_CHARS)
    dataset: str | None = Field(
        None,
        min_length=1,
        max_length=NAME_CHARS,
        description="file id from POST /v1/files (an embedder job may name a 'collection' instead)",
    )
    collection: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="embedder jobs: a retrieval collection of yours whose titles and headings are paired "
        "with their passages (no labels needed); with 'dataset' too, both sets of pairs train",
    )
    positives: PositivesAs | None = Field(
        None,
        description="embedder jobs: 'chunks' (needs 'collection') trains each labelled pair on the chunk "
        "of its document (a beir qrel's corpus id, a pair's document_id) nearest its query by the base "
        "model, as the collection indexes it (title and headings, then the chunk), rather than on the "
        "whole document ('documents'). Default: 'chunks' when the job has a collection and its pairs "
        "name documents, else 'documents'",
    )
    stages: Stages | None = Field(
        None,
        description="embedder jobs with a 'collection' and labelled pairs: 'titles_first' trains the "
        "title and heading pairs (title_epochs), then the labelled pairs (n_epochs), each stage with its "
        "own learning-rate schedule; 'together' trains one shuffled set. Default: 'titles_first' where "
        "both are there (services/trainer/defaults.py says why), else 'together'",
    )
    apply: bool = Field(
        False,
        description="embedder jobs with a 'collection': publish the embedder and switch the collection to "
        "it only if it ranks the held-out pairs (eval_fraction, 0.1 by default) better than the "
        "collection's current embedder (nDCG@10, hybrid search); the job's 'apply' says what was decided",
    )
    title_pairs: bool = Field(
        True,
        description="embedder jobs with a 'collection': also train on its titles and headings paired with "
        "their passages; false: the collection only maps labelled positives to chunks and gives hard "
        "negatives (a labelled job started from the tenant's own title fine-tune)",
    )
    generate_queries: QueryGeneration | None = Field(
        None,
        description="embedder jobs: also train on questions the inference service writes for sampled "
        "passages of the collection (and of a beir dataset's corpus); written by the job's worker before "
        "it trains and saved as one of your files (the job's generated_dataset)",
    )
    eval_dataset: str | None = Field(None, max_length=NAME_CHARS)
    lora: LoraSpec | None = None
    packing: bool = True
    max_tokens_per_pack: int | None = Field(None, ge=64, le=1 << 20)
    hyperparameters: Hyperparameters = Field(default_factory=lambda: Hyperparameters.model_validate({}))
    reward: RewardSpec | None = None
    queue: Literal["cpu", "gpu", "npu"] | None = None
    publish: bool = Field(
        False, description="serve the result when it succeeds (default true for reader jobs)"
    )
    shared: bool = Field(
        False,
        description="reader jobs, operator keys only: publish the reader for every tenant (the shared "
        "folder, which each tenant resolves after its own readers)",
    )
    name: str | None = Field(
        None,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="shared reader jobs: the name it is published under (default ft-reader-<job>); "
        "publishing a name again replaces that reader, so the agent's default reader is retrained in "
        "place (tandem-reader)",
    )
    resources: ResourcesSpec | None = Field(
        None, description="distributed data-parallel training (torchrun); absent: one process in the worker"
    )
    reader_kind: Literal["cross-encoder", "bi-encoder", "features"] = Field(
        "cross-encoder",
        description="reader jobs: a cross-encoder served by /v1/rerank; 'bi-encoder': a sentence encoder "
        "tuned on each question's candidate sentences (listwise), served by /v1/rerank as cosines; or "
        "'features': a small model over the answer step's signals (rows with 'features'), kept as the "
        "job's artifact (feature_reader.json) and not published",
    )
    eval_fraction: float | None = Field(
        None,
        gt=0.0,
        le=0.5,
        description="hold out this share of the dataset (seeded, whole prompts) for eval metrics before/after",
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_name(cls, value: Any) -> Any:
        return {"function": value} if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _reader_request(cls, data: Any) -> Any:
        """A reader job may leave its base out (the offline all-MiniLM-L6-v2) and is published
        unless it says ``publish: false``."""
        if isinstance(data, dict) and data.get("type") == "reader":
            # a features reader is the job's artifact: nothing to serve through /v1/rerank
            publish = data.get("reader_kind") != "features"
            data = {"base_model": READER_BASE, "publish": publish, **data}
        return data

    @model_validator(mode="after")
    def _reader_fields(self) -> JobCreate:
        if (self.shared or self.name is not None) and self.type != "reader":
            raise ValueError(f"'shared' and 'name' only apply to reader jobs, not {self.type}")
        if self.reader_kind != "cross-encoder" and self.type != "reader":
            raise ValueError(f"'reader_kind' only applies to reader jobs, not {self.type}")
        if self.type != "reader":
            return self
        if self.reader_kind == "features" and (self.publish or self.shared):
            raise ValueError(
                "a 'features' reader is kept as the job's artifact (feature_reader.json): leave "
                "'publish' and 'shared' out"
            )
        if self.lora is not None:
            raise ValueError("'lora' does not apply to reader jobs (they fine-tune the whole cross-encoder)")
        if self.shared and not self.publish:
            raise ValueError("'shared' publishes the reader for every tenant: leave 'publish' true")
        if self.name is not None and not self.shared:
            raise ValueError("'name' names a shared reader: set 'shared' (an operator key) too")
        return self

    @model_validator(mode="after")
    def _reward_for_rl(self) -> JobCreate:
        if self.type in ("ppo", "grpo") and self.reward is None:
            raise ValueError(
                f"a {self.type} job needs 'reward' (a registered function name or a reward-model folder)"
            )
        if self.type not in ("ppo", "grpo") and self.reward is not None:
            raise ValueError(f"'reward' only applies to ppo and grpo jobs, not {self.type}")
        return self

    @model_validator(mode="after")
    def _embedder_fields(self) -> JobCreate:
        if self.type == "embedder":
            if self.dataset is None and self.collection is None:
                raise ValueError(
                    "an embedder job needs 'dataset' (pairs or beir rows), 'collection', or both"
                )
            if self.lora is not None:
                raise ValueError("'lora' does not apply to embedder jobs (they fine-tune the whole encoder)")
            hp = self.hyperparameters
            # (a job with a collection and no hard_negatives given gets the default count)
            count_given = "hard_negatives" in hp.model_fields_set or self.collection is None
            if hp.hard_negatives_from == "collection" and hp.hard_negatives == 0 and count_given:
                raise ValueError(
                    "hyperparameters.hard_negatives_from 'collection' takes hard_negatives negatives per pair "
                    "from the collection's ranking: set hyperparameters.hard_negatives above 0"
                )
            if self.apply and self.collection is None:
                raise ValueError(
                    "'apply' needs the job's 'collection' (the collection to switch to the new embedder): "
                    "name a 'collection', or leave 'apply' out"
                )
            if self.apply:
                self.publish = True  # the collection switches to the published embedder
            if self.collection is None:
                needs = [
                    f"{name} {value!r}"
                    for name, value, default in (
                        ("positives", self.positives or "documents", "documents"),
                        ("stages", self.stages or "together", "together"),
                        (
                            "hyperparameters.hard_negatives_from",
                            self.hyperparameters.hard_negatives_from,
                            "model",
                        ),
                    )
                    if value != default
                ]
                if needs:
                    raise ValueError(f"{needs[0]} needs the job's 'collection' (the collection it maps to)")
            elif not self.title_pairs and self.dataset is None and self.generate_queries is None:
                raise ValueError(
                    "title_pairs false leaves a job with only a 'collection' no pairs: give a 'dataset' "
                    "or 'generate_queries', or keep title_pairs"
                )
            return self
        if self.dataset is None:
            raise ValueError(f"a {self.type} job needs 'dataset' (a file id from POST /v1/files)")
        if self.collection is not None:
            raise ValueError(f"'collection' only applies to embedder jobs, not {self.type}")
        if self.generate_queries is not None:
            raise ValueError(f"'generate_queries' only applies to embedder jobs, not {self.type}")
        extra = [
            name
            for name, on in (
                ("positives", self.positives not in (None, "documents")),
                ("title_pairs", not self.title_pairs),
                ("stages", self.stages not in (None, "together")),
                ("apply", self.apply),
            )
            if on
        ]
        if extra:
            raise ValueError(f"'{extra[0]}' only applies to embedder jobs, not {self.type}")
        # by value, not by fields set: a stored spec, read back, has every field set
        hp = self.hyperparameters
        own = READER_ALSO if self.type == "reader" else ()
        wrong = [
            k
            for k in EMBEDDER_ONLY
            if k not in own and getattr(hp, k) != Hyperparameters.model_fields[k].default
        ]
        if wrong:
            raise ValueError(f"hyperparameters.{wrong[0]} only applies to embedder jobs, not {self.type}")
        return self

    @model_validator(mode="after")
    def _eval_and_loss_type(self) -> JobCreate:
        if self.eval_fraction is not None and self.eval_dataset is not None:
            raise ValueError("give 'eval_dataset' or 'eval_fraction', not both")
        if self.eval_fraction is not None and self.type in ("ppo", "grpo"):
            raise ValueError(
                f"eval_fraction applies to jobs with a loss (sft, dpo, simpo, orpo, kto), not {self.type}"
            )
        if self.hyperparameters.loss_type != "sigmoid" and self.type != "dpo":
            raise ValueError(
                f"hyperparameters.loss_type {self.hyperparameters.loss_type!r} only applies to dpo jobs, not {self.type}"
            )
        return self

    @model_validator(mode="after")
    def _type_defaults(self) -> JobCreate:
        """Fill the hyperparameters the request left out with this job type's defaults (so
        the stored request shows what ran)."""
        from services.trainer.defaults import defaults_for

        hp = self.hyperparameters
        missing = {
            k: v
            for k, v in defaults_for(
                recipe_kind(self.type, self.reader_kind),
                lora=self.lora is not None,
                collection=self.collection is not None,
            ).items()
            if k not in hp.model_fields_set
        }
        if (
            missing.get("hard_negatives_from") == "collection"
            and missing.get("hard_negatives", hp.hard_negatives) == 0
        ):
            del missing["hard_negatives_from"]  # the request asked for no negatives
        if self.apply and self.eval_fraction is None and self.eval_dataset is None:
            self.eval_fraction = APPLY_HELD_OUT
        if self.type == "reader" and self.eval_fraction is None and self.eval_dataset is None:
            self.eval_fraction = READER_HELD_OUT
        if missing:
            self.hyperparameters = hp.model_copy(update=missing)
            self.hyperparameters.model_fields_set.update(missing)
        return self


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    filename: str
    bytes: int
    rows: int
    format: str
    kinds: list[str]
    created_at: float


class Progress(BaseModel):
    step: int = 0
    total: int = 0


class ApplyOutcome(BaseModel):
    """What an embedder job with ``apply`` decided: the collection's nDCG@10 on the held-out
    queries with its embedder (before) and the new one (after), and whether it switched."""

    applied: bool | None = None
    yardstick: str = Field(
        description="what the held-out queries are: 'labelled pairs' or 'titles and headings'"
    )
    held_out: int = Field(description="held-out queries scored")
    mode: str = "hybrid"
    before: float | None = None
    after: float | None = None
    reason: str = ""
    reindex_job: str | None = None


class Job(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    type: JobType
    status: JobStatus
    base_model: str
    dataset: str  # an embedder job from a collection alone: the file its pairs were snapshotted to
    eval_dataset: str | None = None
    collection: str | None = None
    # embedder jobs with generate_queries: the file of the questions, null until the worker has
    # written them (a job from a collection alone names that file as its dataset from the start)
    generated_dataset: str | None = None
    queue: str
    progress: Progress
    metrics: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    fine_tuned_model: str | None = None
    published: bool = False
    request: dict[str, Any] = Field(default_factory=dict)
    # embedder jobs with apply: whether the collection switched to the new embedder (null until
    # decided), and the figures and reason of that decision
    applied: bool | None = None
    apply: ApplyOutcome | None = None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Job]


class Artifact(BaseModel):
    path: str
    bytes: int
    kind: Literal["checkpoint", "final"]
    url: str


class ArtifactList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Artifact]
