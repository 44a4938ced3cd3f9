"""The trainer's job logic behind the routes: checking a job's files and queueing it, its artifacts.

The routers (services/trainer/api/) only parse the request and shape the answer; uploads are
checked and kept by ``uploads``.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequest, NotFound
from services.trainer import chunk_pairs
from services.trainer.collection import CollectionDoc, check_writable, collection_documents
from services.trainer.data.formats import PairRecord
from services.trainer.data.pairs import TITLE_STAGE, EmbedderPair
from services.trainer.jobspec import (
    KIND_OF,
    JobOwner,
    check_own_artifact,
    embedder_corpus,
    validate_embedder_job,
    validate_job,
)
from services.trainer.paths import artifact_dir, dataset_path, job_dir
from services.trainer.protocol import Artifact, JobCreate
from services.trainer.publish import check_publishable
from services.trainer.questions import Sampled
from services.trainer.state import TrainerState
from services.trainer.store import JobRecord, new_id
from services.trainer.uploads import store_upload


def check_files(st: TrainerState, tenant: str, spec: JobCreate) -> tuple[Path | None, Path | None]:
    kind = KIND_OF[spec.type]
    paths: list[Path | None] = []
    for param, fid in (("dataset", spec.dataset), ("eval_dataset", spec.eval_dataset)):
        if fid is None:
            paths.append(None)
            continue
        meta = st.store.get_file(tenant, fid, param=param)
        kinds = json.loads(meta["kinds"])
        if kind not in kinds:
            raise InvalidRequest(
                f"{param}: file {fid!r} is in {meta['format']} format, which suits {', '.join(kinds)} jobs, not {spec.type}",
                param=param,
            )
        paths.append(dataset_path(st.common, tenant, fid))
    return paths[0], paths[1]


def snapshot_collection(
    st: TrainerState,
    tenant: str,
    name: str,
    docs: dict[str, CollectionDoc],
    *,
    required: bool = True,
    documents: int | None = None,
    seed: int = 0,
) -> str | None:
    """The label-free pairs of collection ``name`` (titles and headings with their passages,
    each naming its document), of a seeded sample of ``documents`` documents when it has more,
    saved as one of the tenant's dataset files; its id (``None`` when it has none and they are
    not ``required``). The job trains on this fixed snapshot: a resumed job sees the same pairs
    however the collection has changed meanwhile."""
    from services.trainer.data.pairs import title_pairs

    ids = sorted(docs)
    if documents is not None and len(ids) > documents:
        ids = sorted(random.Random(seed).sample(ids, documents))
    pairs = title_pairs([(docs[i].title, docs[i].text) for i in ids], ids)
    if not pairs and not required:
        return None
    if len(pairs) < 2 and required:
        raise InvalidRequest(
            f"collection {name!r}: {len(docs)} documents give {len(pairs)} title/heading-passage pair(s); "
            "label-free training needs at least 2 (documents with a title, or Markdown headings)",
            param="collection",
        )
    data = b"".join(json.dumps(p).encode() + b"\n" for p in pairs)
    record = store_upload(st, tenant, io.BytesIO(data), f"collection-{name}.jsonl")
    return str(record["id"])


def prepare_questions(
    st: TrainerState,
    key: str,
    spec: JobCreate,
    documents: list[tuple[str, str, str]],
    collection_ids: set[str],
) -> tuple[list[Sampled], str]:
    """The passages sampled from ``documents`` (``(id, title, text)``) that the job's worker
    writes questions for, and the first one's reply, asked now with the caller's own key: a
    model the caller may not use fails the request, not the job minutes later."""
    from services.trainer.data.queries import passages, sample
    from services.trainer.questions import ask, seed_of, service_key

    gen = spec.generate_queries
    assert gen is not None
    if gen.passages > st.settings.max_generated_queries:
        raise InvalidRequest(
            f"generate_queries.passages {gen.passages} is more than this server writes for one job "
            f"(TANDEM_TRAINER_MAX_GENERATED_QUERIES={st.settings.max_generated_queries})",
            param="generate_queries.passages",
        )
    picked = sample(passages(documents), gen.passages, spec.hyperparameters.seed)
    if not picked:
        raise InvalidRequest(
            "generate_queries: no passages to write questions for; name a 'collection' with documents, or a "
            "beir 'dataset' (its corpus)",
            param="generate_queries",
        )
    service_key(st.common)  # the worker asks the rest with it: refused now without it
    first = ask(
        st.common,
        gen,
        picked[0].text,
        seed_of(spec.hyperparameters.seed, 0),
        {"Authorization": f"Bearer {key}"},
    )
    return [Sampled(p, p.document in collection_ids) for p in picked], first


def check_documents(paths: dict[str, Path | None], name: str, docs: dict[str, CollectionDoc]) -> None:
    """A pair naming a ``document_id`` (the feedback export's usage pairs do) must name a
    document of the job's collection: one deleted since is a 400 naming its file and line."""
    from services.trainer.jobspec import load_records

    for param, path in paths.items():
        if path is None:
            continue
        for rec in load_records(path, "embedder", param=param):
            doc = rec.document_id if isinstance(rec, PairRecord) else None
            if doc is not None and doc not in docs:
                raise InvalidRequest(
                    f"{param}: line {rec.line}: the positive's document_id {doc!r} is not a document of "
                    f"collection {name!r} (deleted since?); drop the row or name another collection",
                    param=param,
                )


def create_job(st: TrainerState, tenant: str, spec: JobCreate, key: str = "") -> JobRecord:
    """Validate everything (files, model, LoRA targets, lengths, reward), then queue the job."""
    dataset, eval_ds = check_files(st, tenant, spec)
    owner = JobOwner(tenant, st.store)
    if spec.type == "embedder":
        return _create_embedder_job(st, tenant, spec, key, dataset, eval_ds, owner)
    assert dataset is not None  # JobCreate requires it for every other type
    if spec.reward is not None and spec.reward.model is not None:
        check_own_artifact(spec.reward.model, st.common, owner, "reward.model")
    resolved = validate_job(spec, dataset, eval_ds, st.common, st.settings, owner)
    # a job from an adapter keeps that adapter's rank; otherwise the rank asked for
    lineage = resolved.lineage
    if lineage and lineage.init_adapter and spec.lora is not None and lineage.parent_rank is not None:
        # the job trains the parent adapter further: record the rank it really has
        spec = spec.model_copy(update={"lora": spec.lora.model_copy(update={"r": lineage.parent_rank})})
    check_publishable(st.common, spec, spec.lora.r if spec.lora else None)
    return _queue(st, tenant, spec, resolved.model_path, f"{len(resolved.records)} rows")


def _queue(
    st: TrainerState,
    tenant: str,
    spec: JobCreate,
    model_path: Path,
    what: str,
    extra: dict[str, str] | None = None,
    job_id: str | None = None,
) -> JobRecord:
    """Record the checked job and put it on its queue."""
    job_id = job_id or new_id("ftjob")
    queue = spec.queue or st.settings.default_queue
    fields = {
        "type": spec.type,
        "spec": spec.model_dump_json(),
        "queue": queue,
        "model_path": str(model_path),
    }
    st.store.create_job(tenant, job_id, {**fields, **(extra or {})})
    st.store.log(job_id, f"queued on {queue!r}: {what}, base model {model_path}")
    st.dispatch(job_id, queue)
    return st.store.record(job_id)


def resolve_recipe(spec: JobCreate, labelled: list[EmbedderPair]) -> JobCreate:
    """``spec`` with the recipe choices it left open made (the stored request shows what ran):
    ``positives`` "chunks" when the job has a collection and every labelled pair names its
    document, and ``stages`` "titles_first" when it has a collection's titles and labelled pairs
    (defaults.py holds the figures that chose both). ``labelled``: the dataset file's pairs."""
    from services.trainer.data.pairs import doc_ref

    update: dict[str, Any] = {}
    if spec.positives is None:
        named = bool(labelled) and all(doc_ref(p) is not None for p in labelled)
        update["positives"] = "chunks" if spec.collection and named else "documents"
    if spec.stages is None:
        both = spec.collection is not None and spec.title_pairs and bool(labelled)
        update["stages"] = "titles_first" if both else "together"
    return spec.model_copy(update=update) if update else spec


def _create_embedder_job(
    st: TrainerState,
    tenant: str,
    spec: JobCreate,
    key: str,
    dataset: Path | None,
    eval_ds: Path | None,
    owner: JobOwner,
) -> JobRecord:
    snapshot = None
    docs: dict[str, CollectionDoc] = {}
    from services.trainer.data.pairs import embedder_data
    from services.trainer.jobspec import load_records

    # the file's pairs, read once: they choose the recipe and name the chunks to prepare
    labelled = embedder_data(load_records(dataset, "embedder")).pairs if dataset is not None else []
    spec = resolve_recipe(spec, labelled)
    if spec.apply:
        from services.trainer.questions import service_key

        service_key(st.common, "apply")  # the worker switches the collection with it: refused now without it
        if spec.collection:
            check_writable(st, key, spec.collection)  # ... as the tenant: the caller must be a writer
    if spec.collection:
        docs = collection_documents(st, key, spec.collection)
        check_documents({"dataset": dataset, "eval_dataset": eval_ds}, spec.collection, docs)
        if spec.title_pairs:
            # with generated questions too, a collection without titles or headings still trains
            snapshot = snapshot_collection(
                st,
                tenant,
                spec.collection,
                docs,
                required=spec.generate_queries is None,
                documents=spec.hyperparameters.title_documents,
                seed=spec.hyperparameters.seed,
            )
    snap_path = dataset_path(st.common, tenant, snapshot) if snapshot else None
    pending = spec.generate_queries is not None
    # with questions to write, pairs may come from them alone: the worker checks again after
    resolved = validate_embedder_job(
        spec, dataset, eval_ds, st.common, owner, snap_path, None, questions_pending=pending
    )
    job_id = new_id("ftjob")
    extra: dict[str, str] = {}
    what = ""
    if chunk_pairs.wanted(spec):
        # negatives for the labelled pairs that train (a title stage trains on in-batch ones)
        training = [r for r in resolved.records if r.get("_stage") != TITLE_STAGE]
        prepared = chunk_pairs.prepare(st, key, spec, labelled, training, docs)
        chunk_pairs.save(job_dir(st.common, job_id), prepared)
        what = (
            f"{len(prepared.chunks)} documents' chunks, "
            f"{sum(map(len, prepared.negatives.values()))} negatives from collection {spec.collection!r}"
        )
    if spec.generate_queries is not None:
        from services.trainer.questions import questions_dir, save_passages, save_replies

        corpus = embedder_corpus(dataset) if dataset is not None else {}
        documents = [(i, d.title, d.text) for i, d in docs.items()] + [(i, "", x) for i, x in corpus.items()]
        picked, first = prepare_questions(st, key, spec, documents, set(docs))
        root = questions_dir(job_dir(st.common, job_id))
        save_passages(root, picked)
        save_replies(root, {0: first})
        # the file the worker saves the questions to (the job's generated_dataset once written)
        extra["generated_target"] = new_id("file")
        what = (
            what + "; " if what else ""
        ) + f"questions for {len(picked)} passages to write ({spec.generate_queries.model})"
    if spec.dataset is None:  # a collection alone: its snapshot (or the questions' file) is the job's dataset
        spec = spec.model_copy(update={"dataset": snapshot or extra["generated_target"]})
    elif snapshot:
        extra["collection_file"] = snapshot
    held = len(resolved.eval_records or [])
    what = f"{len(resolved.records)} pairs ({held} held out)" + (f"; {what}" if what else "")
    return _queue(st, tenant, spec, resolved.model_path, what, extra, job_id)


def _artifact_roots(st: TrainerState, job_id: str) -> dict[str, Path]:
    return {
        "checkpoints": job_dir(st.common, job_id) / "checkpoints",
        "final": artifact_dir(st.common, job_id),
    }


def artifacts(st: TrainerState, job_id: str) -> list[Artifact]:
    """The job's checkpoint and final files (not the ones still being written)."""
    out = []
    for top, root in _artifact_roots(st, job_id).items():
        if not root.is_dir():
            continue
        for f in sorted(root.rglob("*")):
            if f.is_file() and not any(part.startswith(".tmp") for part in f.relative_to(root).parts):
                rel = f"{top}/{f.relative_to(root).as_posix()}"
                out.append(
                    Artifact(
                        path=rel,
                        bytes=f.stat().st_size,
                        kind="final" if top == "final" else "checkpoint",
                        url=f"/v1/jobs/{job_id}/artifacts/{rel}",
                    )
                )
    return out


def artifact_file(st: TrainerState, job_id: str, path: str) -> Path:
    """The file ``path`` names (``checkpoints/...`` or ``final/...``); nothing outside them (404)."""
    top, _, rest = path.partition("/")
    roots = _artifact_roots(st, job_id)
    if top not in roots or not rest:
        raise NotFound(f"no artifact {path!r}", param="path")
    root = roots[top].resolve()
    target = (root / rest).resolve()
    if not target.is_relative_to(root) or not target.is_file():
        raise NotFound(f"no artifact {path!r}", param="path")
    return target
