"""Test doubles for what the agent service's unit tests are *not* about: the retrieval and
inference services. They speak the real wire shapes (issue 3's search API, OpenAI's chat
completions with SSE) over real HTTP; the integration tests use the real services instead."""

from __future__ import annotations

import asyncio
import html
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.agent.prompting import DATA_KINDS, DataKind


@dataclass
class FakeCorpus:
    """collection -> document id -> (title, text); search ranks by shared words."""

    collections: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    seen_headers: list[dict[str, str]] = field(default_factory=list)

    def search(self, collection: str, query: str, top_k: int) -> list[dict[str, Any]]:
        words = set(re.findall(r"\w+", query.lower()))
        hits = []
        for doc_id, (title, text) in self.collections[collection].items():
            score = len(words & set(re.findall(r"\w+", text.lower())))
            if score:
                hits.append(
                    {
                        "chunk_id": f"{doc_id}#0",
                        "document_id": doc_id,
                        "text": text,
                        "score": float(score),
                        "scores": {"sparse": float(score)},
                        "metadata": {"title": title},
                        "start": 0,
                        "end": len(text),
                    }
                )
        hits.sort(key=lambda h: -h["score"])
        return hits[:top_k]


def retrieval_double(corpus: FakeCorpus) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/collections/{name}/search")
    async def search(name: str, request: Request) -> Any:
        corpus.seen_headers.append(dict(request.headers))
        if name not in corpus.collections:
            return JSONResponse(
                {"error": {"type": "not_found_error", "message": f"no collection {name!r}"}}, status_code=404
            )
        body = await request.json()
        return {"results": corpus.search(name, body["query"], body.get("top_k", 10))}

    @app.get("/v1/collections/{name}/documents/{doc_id}")
    async def document(name: str, doc_id: str) -> Any:
        title, text = corpus.collections[name][doc_id]
        return {"id": doc_id, "title": title, "text": text}

    @app.get("/v1/collections/{name}")
    async def collection(name: str) -> Any:
        if name not in corpus.collections:
            return JSONResponse(
                {"error": {"type": "not_found_error", "message": f"no collection {name!r}"}}, status_code=404
            )
        return {"name": name, "documents": len(corpus.collections[name])}

    return app


# -- reading prompts as a model double: the data blocks prompting.data_block writes ----------------
# Strict on purpose: a block the product wrote in any other shape is not found, and the double
# then answers as if it had no sources, so a format drift fails the tests that depend on it.
_DATA_BLOCK = re.compile(
    r"<(?P<kind>" + "|".join(DATA_KINDS) + r')(?P<attrs>(?: [\w-]+="[^"]*")*)>\n(?P<text>.*?)\n</(?P=kind)>',
    re.DOTALL,
)
_ATTRIBUTE = re.compile(r'([\w-]+)="([^"]*)"')


@dataclass(frozen=True)
class DataBlock:
    """One ``<document ...>`` or ``<tool_result ...>`` block of a prompt. ``text`` is what the model
    reads (data-block tags inside it stay escaped); attribute values are unescaped."""

    kind: DataKind
    attributes: dict[str, str]
    text: str


def data_blocks(prompt: str, kind: DataKind | None = None) -> list[DataBlock]:
    """The data blocks of ``prompt`` in order, only those of ``kind`` when given."""
    blocks = [
        DataBlock(
            m["kind"],  # type: ignore[arg-type]  # the pattern only matches DATA_KINDS
            {k: html.unescape(v) for k, v in _ATTRIBUTE.findall(m["attrs"])},
            m["text"],
        )
        for m in _DATA_BLOCK.finditer(prompt)
    ]
    return [b for b in blocks if kind is None or b.kind == kind]


def outside_data_blocks(prompt: str) -> str:
    """``prompt`` with its data blocks cut out: what it says that no document or tool wrote."""
    return _DATA_BLOCK.sub("", prompt)


def prompt_sources(body: dict[str, Any]) -> list[DataBlock]:
    """The numbered documents of a chat request: those of its last user message that holds any
    (tool calls and their results may follow the question)."""
    for msg in reversed(body.get("messages", [])):
        content = msg.get("content")
        if (
            msg.get("role") == "user"
            and isinstance(content, str)
            and (docs := data_blocks(content, "document"))
        ):
            return docs
    return []


def cite_first(body: dict[str, Any]) -> str:
    """A model that answers with the first line of its first source and cites it."""
    sources = prompt_sources(body)
    first = sources[0].text.split("\n", 1)[0].strip() if sources else "nothing"
    return f"According to the sources, {first} [1]."


@dataclass
class Refusal:
    """A scripted reply that is an error status in OpenAI's shape (an engine refusing a field)."""

    message: str
    param: str | None = None
    status: int = 400


Reply = str | dict[str, Any] | Refusal
Script = Callable[[dict[str, Any]], Reply]
# A reader: (question, passages) -> one score per passage.
ReaderScript = Callable[[str, list[str]], list[float]]


@dataclass
class ScriptedModel:
    """An OpenAI-compatible chat model that answers from a script (a list of replies, or a function
    of the request). A reply is text, or a dict message (for tool calls). ``delay`` is per token."""

    replies: list[Reply] | Script = field(default_factory=list)
    delay: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    disconnected: int = 0
    # GET /v1/models: the shared models every key sees, plus each key's own (a tenant's fine-tunes).
    shared: list[str] = field(default_factory=lambda: ["scripted"])
    own: dict[str, list[str]] = field(default_factory=dict)
    # Embedding models listed beside the chat models, as the inference service lists them.
    embedding: list[str] = field(default_factory=lambda: ["all-MiniLM-L6-v2"])
    # Readers /v1/rerank serves (listed as kind "rerank" with their threshold); any other name
    # is a 404, as the inference service answers for a reader it does not serve.
    readers: dict[str, ReaderScript] = field(default_factory=dict)
    reader_thresholds: dict[str, float] = field(default_factory=dict)
    reader_kinds: dict[str, str] = field(default_factory=dict)  # listed as the card's reader_kind
    reranks: list[dict[str, Any]] = field(default_factory=list)

    def next_reply(self, body: dict[str, Any]) -> Reply:
        if callable(self.replies):
            return self.replies(body)
        return self.replies.pop(0) if self.replies else "Final Answer: (script exhausted)"


def inference_double(model: ScriptedModel) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        # an operator key acting for a tenant (X-Tandem-Tenant) sees that tenant's own models
        acting = request.headers.get("x-tandem-tenant", "")
        ids = [*model.shared, *model.own.get(key, []), *(model.own.get(acting, []) if acting else [])]
        cards = [{"id": i, "object": "model"} for i in ids]
        cards += [{"id": i, "object": "model", "kind": "embedding"} for i in model.embedding]
        cards += [
            {
                "id": i,
                "object": "model",
                "kind": "rerank",
                "threshold": model.reader_thresholds.get(i),
                "reader_kind": model.reader_kinds.get(i, "cross-encoder"),
            }
            for i in model.readers
        ]
        return {"object": "list", "data": cards}

    @app.post("/v1/rerank")
    async def rerank(request: Request) -> Any:
        body = await request.json()
        model.reranks.append(body)
        reader = model.readers.get(body["model"])
        if reader is None:
            error = {
                "type": "not_found_error",
                "message": f"no rerank model {body['model']!r}",
                "param": "model",
            }
            return JSONResponse({"error": error}, status_code=404)
        scores = reader(body["query"], list(body["documents"]))
        return {"results": [{"index": i, "relevance_score": s} for i, s in enumerate(scores)]}

    @app.get("/v1/capabilities")
    async def capabilities() -> Any:
        # What a trainer asks before it accepts a publish: true job (CONTRACT.md).
        return {"engine": "scripted", "adapters": True, "max_lora_rank": 64, "register_models": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        model.requests.append(body)
        model.headers.append(dict(request.headers))
        reply = model.next_reply(body)
        if isinstance(reply, Refusal):
            error = {
                "type": "invalid_request_error",
                "message": reply.message,
                "param": reply.param,
                "code": None,
            }
            return JSONResponse({"error": error}, status_code=reply.status)
        message = reply if isinstance(reply, dict) else {"role": "assistant", "content": reply}
        text = str(message.get("content") or "")
        for stop in body.get("stop") or []:
            if stop in text:
                text = text[: text.index(stop)]
        if not body.get("stream"):
            return {
                "id": "x",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [{"index": 0, "message": {**message, "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }

        async def stream() -> AsyncIterator[bytes]:
            try:
                for piece in re.findall(r"\S+\s*|\s+", text):
                    if model.delay:
                        await asyncio.sleep(model.delay)
                    chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                # a reply's tool calls, in OpenAI's pieces: the id, type and name, then the arguments
                calls = message.get("tool_calls") or []
                for i, call in enumerate(calls):
                    head = {"index": i, "id": call["id"], "type": "function"}
                    pieces = [
                        {**head, "function": {"name": call["function"]["name"], "arguments": ""}},
                        {"index": i, "function": {"arguments": call["function"]["arguments"]}},
                    ]
                    for piece in pieces:
                        delta = {"tool_calls": [piece]}
                        chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                last = {
                    "choices": [
                        {"index": 0, "delta": {}, "finish_reason": "tool_calls" if calls else "stop"}
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                }
                yield f"data: {json.dumps(last)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                model.disconnected += 1
                raise

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@dataclass
class RecordingTrainer:
    """The trainer's ``POST /v1/files`` (multipart JSONL) and ``POST /v1/jobs``, recording what it got.

    Rows of the formats today's trainer knows (``preference``, ``messages``) are checked with its own
    parser, so a row shape it would refuse fails here too."""

    files: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    file_headers: list[dict[str, str]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    job_headers: list[dict[str, str]] = field(default_factory=list)
    # GET /v1/jobs/{id}: what each job reports (a test moves it along), and the headers of each read
    job_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    read_headers: list[dict[str, str]] = field(default_factory=list)


def trainer_double(trainer: RecordingTrainer) -> FastAPI:
    from starlette.datastructures import UploadFile

    from services.trainer.data.formats import parse_dataset

    app = FastAPI()

    @app.post("/v1/files", status_code=201)
    async def upload(request: Request) -> Any:
        form = await request.form()
        upload = form["file"]
        assert isinstance(upload, UploadFile)
        data = await upload.read()
        rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        fmt = "kto"
        if "label" not in rows[0] or "sentence" in rows[0]:
            parsed = parse_dataset(data)
            fmt = parsed.format
        fid = f"file-{len(trainer.files) + 1}"
        trainer.files[fid] = rows
        trainer.file_headers.append(dict(request.headers))
        return {"id": fid, "object": "file", "filename": upload.filename, "rows": len(rows), "format": fmt}

    @app.post("/v1/jobs", status_code=201)
    async def create_job(request: Request) -> Any:
        body = await request.json()
        trainer.jobs.append(body)
        trainer.job_headers.append(dict(request.headers))
        job_id = f"ftjob-{len(trainer.jobs)}"
        # a job the trainer made is known from then on (queued until a test moves it), as the
        # real trainer's is: the gate may poll it before the test sets its state
        trainer.job_states.setdefault(job_id, {"status": "queued"})
        return {"id": job_id, "object": "fine_tuning.job", "status": "queued", **body}

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request) -> Any:
        trainer.read_headers.append(dict(request.headers))
        if job_id not in trainer.job_states:
            return JSONResponse({"error": {"message": f"no job {job_id!r}"}}, status_code=404)
        return {"id": job_id, "object": "fine_tuning.job", **trainer.job_states[job_id]}

    return app


class FailingTool:
    """A tool whose every call raises ``error`` (the agent must turn it into an observation)."""

    description = "Always fails."
    parameters: ClassVar[dict[str, Any]] = {}

    def __init__(self, name: str, error: Exception) -> None:
        self.name = name
        self.error = error

    def run(self, argument: Any, ctx: Any) -> str:
        raise self.error
