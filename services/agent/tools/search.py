"""Document search over the run's collection, as an agent tool."""

from __future__ import annotations

from typing import Any

from services.agent.tools.base import ToolContext, argument_text, single_string_schema


class DocumentSearch:
    name = "document_search"
    description = "Searches the documents of the current collection. Input: what to look for."
    parameters = single_string_schema("query", "what to search for", max_length=80)
    needs = ("collection",)  # offered only with a collection the caller may read

    def __init__(self, top_k: int = 3, max_chars: int = 400) -> None:
        self.top_k = top_k
        self.max_chars = max_chars

    async def run(self, argument: Any, ctx: ToolContext) -> str:
        if ctx.retrieval is None or not ctx.collection:
            return "error: no collection was given for this conversation"
        query = argument_text(argument, "query")
        chunks = await ctx.retrieval.search(ctx.collection, query, top_k=self.top_k)
        if not chunks:
            return "no matching documents"
        return "\n".join(f"[{c.document_id}] {c.text[: self.max_chars].strip()}" for c in chunks)
