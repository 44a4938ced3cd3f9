"""Writing an embedder job's ``generate_queries``: the calls to the inference service and the
job's first phase on the worker (``services/trainer/data/queries.py`` is the pure part).

``POST /v1/jobs`` samples the passages (it reads the collection with the caller's key, which
the worker does not have), asks the first one's question with the caller's key (a model the
caller may not use fails there), and keeps both in the job's work dir::

    <job dir>/questions/passages.jsonl     the sampled passages, in order ({document, text, cited})
    <job dir>/questions/replies-<i>.json   {index: raw reply} of one batch, written atomically

The worker asks the rest with ``TANDEM_SERVICE_API_KEY`` acting for the job's tenant
(``X-Tandem-Tenant``: the inference service then lets it use exactly what that tenant may),
a batch of ``TANDEM_TRAINER_QUERY_GENERATION_CONCURRENCY`` at a time; between batches it keeps
the replies, reports progress and honours cancel. A worker that dies mid-way leaves the batches
it finished, and the resumed job asks only for the passages without a kept reply.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.common.atomic import atomic_write
from services.common.auth import ACT_FOR_HEADER
from services.common.config import CommonSettings
from services.common.errors import InvalidRequest, ServiceUnavailable
from services.common.replicas import replica_pool, request_sync
from services.common.upstream import UpstreamReply, unreachable, upstream_error
from services.trainer.config import TrainerSettings
from services.trainer.data.pairs import EmbedderPair
from services.trainer.data.queries import Passage, questions
from services.trainer.protocol import QueryGeneration
from services.trainer.state import TrainerState
from services.trainer.store import TrainerStore
from services.trainer.uploads import store_upload

GENERATED_NAME = "generated-queries.jsonl"
TRANSIENT = frozenset({429, 502, 503, 504})  # asked again by the worker (``ask``'s retries)
MAX_WAIT_S = 30.0


@dataclass(frozen=True)
class Sampled:
    passage: Passage
    cited: bool  # a passage of the job's collection: its pair names the document (document_id)


def questions_dir(job_dir: Path) -> Path:
    return job_dir / "questions"


def seed_of(hp_seed: int, index: int) -> int:
    """The sampling seed of passage ``index``: the same job writes the same questions."""
    return hp_seed * 1_000_003 + index


def ask(
    common: CommonSettings,
    gen: QueryGeneration,
    passage: str,
    seed: int,
    headers: dict[str, str],
    *,
    retries: int = 0,
) -> str:
    """The raw reply of the inference service's chat model ``gen.model`` to the prompt for
    ``passage``; its refusal is the error every service maps an upstream's answer to.
    ``retries``: how often a busy (429), unavailable (502-504) or unreachable service is asked
    again, after its Retry-After or 1, 2, 4 ... seconds (at most 30): the worker's questions
    outlast a restart or a burst; the API's one question fails at once."""
    from services.trainer.data.pairs import PASSAGE_CHARS
    from services.trainer.data.queries import PROMPT

    body = {
        "model": gen.model,
        "messages": [{"role": "user", "content": PROMPT.format(passage=passage[:PASSAGE_CHARS])}],
        "max_tokens": gen.max_tokens,
        "temperature": gen.temperature,
        "seed": seed,
    }
    pool = replica_pool(common.inference_replicas())
    for attempt in range(retries + 1):
        last = attempt == retries
        try:
            resp = request_sync(
                pool, "POST", "/v1/chat/completions", json=body, headers=headers, timeout=300.0
            )
        except httpx.HTTPError as exc:
            if last:
                raise unreachable("inference", exc) from None
            time.sleep(min(2.0**attempt, MAX_WAIT_S))
            continue
        if resp.status_code in TRANSIENT and not last:
            reply = UpstreamReply.of("inference", resp)
            time.sleep(min(_seconds(reply.retry_after, 2.0**attempt), MAX_WAIT_S))
            continue
        if resp.status_code >= 400:
            # the mapping every service uses for an upstream's answer (404 stays 404, 429 stays 429)
            param = "generate_queries.model" if resp.status_code in (400, 404) else "generate_queries"
            raise upstream_error(UpstreamReply.of("inference", resp), param)
        return str(resp.json()["choices"][0]["message"].get("content") or "")
    raise AssertionError("unreachable: the last attempt returns or raises")


def _seconds(value: str | None, default: float) -> float:
    try:
        return max(0.0, float(value)) if value is not None else default
    except ValueError:  # an HTTP date: not worth parsing for a 30 s cap
        return default


def service_key(common: CommonSettings, param: str = "generate_queries") -> str:
    """The key the worker calls the other services with (no caller key is kept anywhere); a job
    that would need it (``param`` says for what) is refused without it (503) rather than
    failing after it starts."""
    if not common.service_api_key:
        raise ServiceUnavailable(
            f"{param}: TANDEM_SERVICE_API_KEY is not set, so the trainer's worker cannot call the other "
            f"services for it; set it, or start the job without {param}",
            param=param,
        )
    return common.service_api_key


def acting_headers(common: CommonSettings, tenant: str, param: str = "generate_queries") -> dict[str, str]:
    """The worker's credentials: the operator key, acting for the job's tenant."""
    return {"Authorization": f"Bearer {service_key(common, param)}", ACT_FOR_HEADER: tenant}


def save_passages(root: Path, picked: list[Sampled]) -> None:
    rows = (
        json.dumps(
            {"document": s.passage.document, "text": s.passage.text, "cited": s.cited}, ensure_ascii=False
        )
        for s in picked
    )
    atomic_write(root / "passages.jsonl", "".join(f"{r}\n" for r in rows).encode())


def load_passages(root: Path) -> list[Sampled]:
    out = []
    for line in (root / "passages.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append(Sampled(Passage(row["document"], row["text"]), bool(row["cited"])))
    return out


def save_replies(root: Path, replies: dict[int, str]) -> None:
    """One batch's replies, in a file of its own (named by its first index) written whole."""
    data = json.dumps({str(i): r for i, r in sorted(replies.items())}, ensure_ascii=False)
    atomic_write(root / f"replies-{min(replies):07d}.json", data.encode())


def load_replies(root: Path) -> dict[int, str]:
    """Every kept reply by passage index (a torn write leaves only a hidden temp file, skipped)."""
    out: dict[int, str] = {}
    for path in sorted(root.glob("replies-*.json")):
        out.update({int(i): str(r) for i, r in json.loads(path.read_text()).items()})
    return out


def pair_rows(picked: list[Sampled], replies: dict[int, str]) -> list[EmbedderPair]:
    """The generated pairs: each usable question with its passage (``document_id`` for one of
    the collection's), repeats dropped (``questions``)."""
    cited = {s.passage: s.cited for s in picked}
    rows: list[EmbedderPair] = []
    for p, query in questions([s.passage for s in picked], [replies[i] for i in range(len(picked))]):
        row: EmbedderPair = {"query": query, "positive": p.text}
        if cited[p]:
            row["document_id"] = p.document
        rows.append(row)
    return rows


def _queues_nothing(job_id: str, queue: str) -> None:
    raise RuntimeError(f"the worker writing {job_id}'s questions queues no job")


def write_questions(
    job_id: str,
    tenant: str,
    gen: QueryGeneration,
    hp_seed: int,
    file_id: str,
    *,
    root: Path,
    store: TrainerStore,
    common: CommonSettings,
    settings: TrainerSettings,
    should_stop: Callable[[], bool],
) -> str | None:
    """The job's first phase: ask for every passage without a kept reply, then save the pairs
    as the tenant's file ``file_id``; its id, or ``None`` when the job was cancelled meanwhile."""
    picked = load_passages(root)
    replies = load_replies(root)
    todo = [i for i in range(len(picked)) if i not in replies]
    total = len(picked)
    store.log(
        job_id,
        f"generate_queries: writing questions for {len(todo)} of {total} passages with {gen.model!r} "
        f"({total - len(todo)} answered before)",
    )
    headers = acting_headers(common, tenant) if todo else {}
    batch = settings.query_generation_concurrency
    with ThreadPoolExecutor(batch) as pool:
        for start in range(0, len(todo), batch):
            if should_stop():
                return None
            part = todo[start : start + batch]
            answers = pool.map(
                lambda i: ask(
                    common,
                    gen,
                    picked[i].passage.text,
                    seed_of(hp_seed, i),
                    headers,
                    retries=settings.query_generation_retries,
                ),
                part,
            )
            got = dict(zip(part, answers, strict=True))
            save_replies(root, got)
            replies.update(got)
            store.phase_progress(job_id, "generate_queries", len(replies), total)
    if should_stop():
        return None
    rows = pair_rows(picked, replies)
    summary = f"{len(rows)} generated questions for {total} passages ({gen.model})"
    if len(rows) < 2:
        raise InvalidRequest(
            f"generate_queries: {summary}; at least 2 are needed (the rest of the replies were empty, "
            "longer than a question, or copied the passage)",
            param="generate_queries.model",
        )
    data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)
    st = TrainerState(common, settings, store, dispatch=_queues_nothing)
    store_upload(st, tenant, io.BytesIO(data), GENERATED_NAME, file_id=file_id)
    store.update(job_id, generated_file=file_id)
    store.log(job_id, f"generate_queries: {summary}, saved as {file_id}")
    return file_id
