"""Forwards generation to any OpenAI-compatible server (vLLM, TGI, Ollama, another Tandem).

Requests go upstream as streams (``stream: true`` with usage), whatever the client
asked, so this service can stream to its own clients and count tokens; closing the
stream closes the upstream connection, which makes the upstream server abort too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from services.inference.engine.base import AdapterNotFound, NameTaken, ServedModel
from services.inference.engine.types import (
    AdapterError,
    EngineRequest,
    InvalidParams,
    StreamEvent,
    TokenLogprob,
    TopLogprob,
    UpstreamFailure,
)

# Fields this service interprets itself and never forwards as they came.
_OWN = {"stream", "stream_options"}


class RemoteEngine:
    kind = "remote"

    def __init__(
        self, base_url: str, *, api_key: str = "", timeout: float = 300.0, structured_outputs: bool = True
    ) -> None:
        # whether the upstream honours response_format / guided_grammar (vLLM, OpenAI do):
        # when it does not, such requests are refused here rather than silently unconstrained
        self.structured_outputs = structured_outputs
        root = base_url.rstrip("/")
        self.base = root if root.endswith("/v1") else root + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
        self._names: set[str] = set()

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        await self.client.aclose()

    async def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            resp = await self.client.request(method, self.base + path, json=body)
        except httpx.HTTPError as exc:
            raise UpstreamFailure(f"{self.base} is unreachable: {exc}") from None
        data = _body(resp.content)
        if resp.status_code >= 400:
            raise UpstreamFailure(f"upstream answered {resp.status_code}", resp.status_code, data)
        return data

    async def models(self) -> list[ServedModel]:
        data = await self._json("GET", "/models")
        out = []
        for m in data.get("data", []) if isinstance(data, dict) else []:
            if m.get("kind") in ("embedding", "rerank"):  # an upstream Tandem's: not chat models
                continue
            kind = "adapter" if m.get("parent") else "base"
            out.append(
                ServedModel(str(m["id"]), kind, parent=m.get("parent"), max_model_len=m.get("max_model_len"))
            )
        self._names = {m.id for m in out}
        return out

    def serves(self, model: str) -> bool:
        # the upstream decides (an unknown name comes back as its 404)
        return True

    async def health(self) -> dict[str, object]:
        await self.models()
        return {"engine": self.kind, "upstream": self.base}

    async def abort(self, request_id: str) -> None:
        # closing the stream (the consumer does) is the abort
        return None

    async def load_adapter(self, name: str, path: str) -> None:
        try:
            await self._json("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except UpstreamFailure as exc:
            raise (
                NameTaken(name, _message(exc)) if exc.status_code == 409 else AdapterError(_message(exc))
            ) from None

    async def unload_adapter(self, name: str) -> None:
        try:
            await self._json("POST", "/unload_lora_adapter", {"lora_name": name})
        except UpstreamFailure as exc:
            raise AdapterNotFound(
                name, f"no adapter named {name!r} is loaded upstream: {_message(exc)}"
            ) from None

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        chat = request.messages is not None
        guided = request.params.guided
        # a forced tool call's grammar (param "tools") is the upstream's business: it gets
        # tools and tool_choice as sent, and its tool_calls come back as they are
        if guided is not None and guided.param != "tools" and not self.structured_outputs:
            raise InvalidParams(
                f"{guided.param}: the remote engine's upstream does not support structured output "
                "(TANDEM_INFERENCE_REMOTE_STRUCTURED_OUTPUTS=false)",
                guided.param,
            )
        body = {k: v for k, v in request.extra.items() if k not in _OWN}
        body.update(stream=True, stream_options={"include_usage": True})
        if request.model:
            body["model"] = request.model
        if request.prompt_token_ids is not None and not chat:
            body["prompt"] = request.prompt_token_ids
        path = "/chat/completions" if chat else "/completions"
        req = self.client.build_request("POST", self.base + path, json=body)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise UpstreamFailure(f"{self.base} is unreachable: {exc}") from None
        if resp.status_code >= 400:
            content = await resp.aread()
            await resp.aclose()
            raise UpstreamFailure(f"upstream answered {resp.status_code}", resp.status_code, _body(content))
        return self._events(resp, chat, request.params.n)

    async def _events(self, resp: httpx.Response, chat: bool, n: int) -> AsyncIterator[StreamEvent]:
        counts: dict[int, int] = {}
        finished: dict[int, StreamEvent] = {}
        usage: dict[str, int] | None = None
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    yield StreamEvent(0, [], "", None, "error", 0, 0, error=str(err.get("message", err)))
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    idx = int(choice.get("index", 0))
                    text = (
                        (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""
                    )
                    entries = _logprobs(choice.get("logprobs"), chat)
                    calls = (choice.get("delta") or {}).get("tool_calls") if chat else None
                    if text or entries or calls:
                        counts[idx] = counts.get(idx, 0) + max(1, len(entries or []))
                        yield StreamEvent(
                            idx, [], text, entries, None, 0, counts[idx], tool_calls=calls or None
                        )
                    if choice.get("finish_reason"):
                        # held back until usage arrives, so the counts are the upstream's
                        finished[idx] = StreamEvent(
                            idx, [], "", None, choice["finish_reason"], 0, counts.get(idx, 0)
                        )
        finally:
            await resp.aclose()
        per_prompt = int(usage.get("prompt_tokens", 0)) if usage else 0
        completion = int(usage.get("completion_tokens", 0)) if usage else 0
        for idx in sorted(finished):
            ev = finished[idx]
            ev.prompt_tokens = per_prompt
            if usage and len(finished) == 1:
                ev.completion_tokens = completion
            yield ev
        for idx in range(n):
            if idx not in finished:
                yield StreamEvent(
                    idx,
                    [],
                    "",
                    None,
                    "error",
                    per_prompt,
                    counts.get(idx, 0),
                    error="upstream stream ended early",
                )


def _body(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return {"error": {"message": content.decode("utf-8", "replace")[:500]}}


def _message(exc: UpstreamFailure) -> str:
    err = (exc.body or {}).get("error") if isinstance(exc.body, dict) else None
    return str(err.get("message")) if isinstance(err, dict) else str(exc)


def _logprobs(raw: Any, chat: bool) -> list[TokenLogprob] | None:
    if not raw:
        return None
    if chat:
        return [
            TokenLogprob(
                -1,
                e["token"],
                float(e["logprob"]),
                [TopLogprob(-1, t["token"], float(t["logprob"])) for t in e.get("top_logprobs") or []],
            )
            for e in raw.get("content") or []
        ]
    tops = raw.get("top_logprobs") or [None] * len(raw.get("tokens", []))
    return [
        TokenLogprob(-1, tok, float(lp), [TopLogprob(-1, k, float(v)) for k, v in (top or {}).items()])
        for tok, lp, top in zip(raw.get("tokens", []), raw.get("token_logprobs", []), tops, strict=False)
    ]
