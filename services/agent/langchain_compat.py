"""LangChain integration: Tandem tools as ``BaseTool``, the retrieval service as a ``BaseRetriever``.

(The third direction, a LangChain ``Runnable`` as a pipeline component, is the
``langchain_runnable`` node type in ``pipelines/components.py``.)
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.tools import BaseTool
from pydantic import BaseModel, ConfigDict, Field, create_model

from services.agent.chunks import Chunk
from services.agent.clients import RetrievalClient
from services.agent.tools.base import Tool, ToolContext, call_tool
from services.common.jsonsafe import JsonObject
from services.common.upstream import UpstreamReply, upstream_error


def _args_schema(tool: Tool) -> type[BaseModel]:
    props = (getattr(tool, "parameters", None) or {}).get("properties") or {"input": {"type": "string"}}
    fields: dict[str, Any] = {
        name: (str, Field(..., description=str(spec.get("description", "")))) for name, spec in props.items()
    }
    return create_model(f"{tool.name.title().replace('_', '')}Args", **fields)


class TandemTool(BaseTool):
    """A Tandem ``Tool`` usable by LangChain agents (sync and async), with the same time limit and
    error-as-observation behaviour as inside Tandem's own agents."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    tool: Any
    ctx: Any = None
    timeout_s: float = 10.0

    def _argument(self, kwargs: JsonObject) -> Any:
        return next(iter(kwargs.values())) if len(kwargs) == 1 else kwargs

    async def _arun(self, **kwargs: Any) -> str:
        observation, _ = await call_tool(
            self.tool, self._argument(kwargs), self.ctx or ToolContext(), self.timeout_s
        )
        return observation

    def _run(self, **kwargs: Any) -> str:
        if inspect.iscoroutinefunction(self.tool.run):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return asyncio.run(self._arun(**kwargs))
            # Called synchronously from inside an event loop: run the coroutine on a loop of its own.
            with ThreadPoolExecutor(max_workers=1) as pool:
                return pool.submit(asyncio.run, self._arun(**kwargs)).result()
        result = self.tool.run(self._argument(kwargs), self.ctx or ToolContext())
        return result if isinstance(result, str) else str(result)


def as_langchain_tool(tool: Tool, ctx: ToolContext | None = None, timeout_s: float = 10.0) -> TandemTool:
    return TandemTool(
        name=tool.name,
        description=tool.description,
        args_schema=_args_schema(tool),
        tool=tool,
        ctx=ctx,
        timeout_s=timeout_s,
    )


def _document(chunk: Chunk) -> Document:
    return Document(
        page_content=chunk.text,
        metadata={
            **chunk.metadata,
            "chunk_id": chunk.chunk_id,
            "document_id": chunk.document_id,
            "title": chunk.title,
            "start": chunk.start,
            "end": chunk.end,
            "score": chunk.score,
        },
    )


class TandemRetriever(BaseRetriever):
    """Search a Tandem collection from LangChain (``invoke``/``ainvoke`` give ``Document``s whose
    metadata carries chunk id, document id, title and character offsets)."""

    base_url: str
    api_key: str
    collection: str
    top_k: int = 5
    mode: Literal["dense", "sparse", "hybrid"] = "hybrid"
    timeout_s: float = 60.0

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        with httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=self.timeout_s,
        ) as client:
            resp = client.post(
                f"/v1/collections/{self.collection}/search",
                json={"query": query, "top_k": self.top_k, "mode": self.mode},
            )
        if resp.status_code >= 400:
            raise upstream_error(UpstreamReply.of("retrieval", resp), param="collection")
        return [_document(Chunk.from_result(r)) for r in resp.json().get("results", [])]

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        client = RetrievalClient(self.base_url, self.api_key, self.timeout_s)
        chunks = await client.search(self.collection, query, top_k=self.top_k, mode=self.mode)
        return [_document(c) for c in chunks]
