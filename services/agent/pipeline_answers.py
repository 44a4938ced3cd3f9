"""Pipelines answering outside a conversation: the run context a pipeline reads, and one
question answered (or read by the answer step alone) and kept nowhere.

A chat turn (services/agent/runtime.py) runs its pipeline with ``context``; evaluation runs
(services/agent/evals/runs.py) and the promotion gate (services/agent/promotions.py) answer with
``answer_unrecorded`` and ``read_unrecorded``: no turn record, no memory, no quality metric, since
an evaluation is not traffic.
"""

from __future__ import annotations

from typing import Any

from services.agent.chunks import Chunk
from services.agent.clients import InferenceClient
from services.agent.config import AgentSettings
from services.agent.events import ErrorEvent
from services.agent.pipelines.components import AnswerSelectNode
from services.agent.pipelines.definition import Pipeline
from services.agent.pipelines.state import RunContext, RunState
from services.agent.prompting import PromptPlan
from services.agent.protocol import ReaderChoice
from services.agent.reader.unserved import UnservedReaders
from services.agent.tokens import load_counter
from services.agent.upstreams import ServedModels, Upstreams
from services.common.errors import ServiceUnavailable


class PipelineAnswers:
    """The agent's pipelines (by name), answering with the caller's key."""

    def __init__(
        self,
        settings: AgentSettings,
        pipelines: dict[str, Pipeline],
        upstreams: Upstreams,
        models: ServedModels,
    ) -> None:
        self.settings = settings
        self.pipelines = pipelines
        self.upstreams = upstreams
        self.models = models
        # one table for every request: a reader's 404 is remembered across answers
        self.unserved = UnservedReaders()

    def fixed_context(self, api_key: str, model: str, inference: InferenceClient | None = None) -> RunContext:
        """The context of steps that answer with ``model`` as given ('' where none generates)."""
        return RunContext(
            settings=self.settings,
            retrieval=self.upstreams.retrieval(api_key),
            inference=inference or self.upstreams.inference(api_key),
            counter=load_counter(self.settings.tokenizer),
            model=model,
            unserved=self.unserved,
            api_key=api_key,
        )

    async def context(
        self,
        pipeline: Pipeline,
        api_key: str,
        llm: str | None,
        reader: ReaderChoice | None,
        inference: InferenceClient | None = None,
    ) -> RunContext:
        """The context ``pipeline`` runs in: ``llm`` (None: the served default, looked up only
        where the pipeline generates) and the tenant's ``reader``."""
        ctx = self.fixed_context(api_key, "", inference)
        if any(n.type == "generator" for n in pipeline.spec.components.values()):
            ctx.model = llm or await self.models.default(ctx.inference)
        ctx.chosen = bool(llm)
        ctx.reader = reader.name if reader else None
        ctx.reader_threshold = reader.threshold if reader else None
        return ctx

    async def answer_unrecorded(
        self,
        api_key: str,
        pipeline_name: str,
        question: str,
        collection: str | None,
        llm: str | None,
        reader: ReaderChoice | None = None,
    ) -> RunState:
        """A pipeline's answer to one question, as a chat turn would get it with ``llm`` (None: the
        served default) and the tenant's ``reader``, kept nowhere."""
        pipeline = self.pipelines[pipeline_name]
        ctx = await self.context(pipeline, api_key, llm, reader)
        state = RunState(question=question, collection=collection)
        async for event in pipeline.run(state, ctx):
            if isinstance(event, ErrorEvent):
                raise ServiceUnavailable(event.message)
        return state

    async def read_unrecorded(
        self,
        api_key: str,
        pipeline_name: str,
        question: str,
        collection: str | None,
        sources: list[dict[str, Any]],
        reader: ReaderChoice,
    ) -> RunState:
        """The answer step of ``pipeline_name`` alone, over ``sources`` (a turn record's retrieved
        chunks, so every reader reads the same), with ``reader``: its selected sentences as the
        answer, or that the documents do not say. Kept nowhere."""
        pipeline = self.pipelines[pipeline_name]
        p = next(
            (n.p for n in pipeline.nodes.values() if isinstance(n, AnswerSelectNode)),
            AnswerSelectNode.P.model_validate({}),
        )
        # the selection is the answer, whatever the pipeline does with it: it is the reader's
        node = AnswerSelectNode(
            p.model_copy(
                update={
                    "enabled": True,
                    "extract": True,
                    "reader": reader.name,
                    "reader_threshold": reader.threshold,
                }
            )
        )
        chunks = [Chunk.from_result(s) for s in sources]
        state = RunState(question=question, collection=collection)
        state.chunks = chunks
        state.plan = PromptPlan(messages=[], sources=chunks, prompt_tokens=0, budget=0)
        async for _ in node.run(state, self.fixed_context(api_key, "")):
            pass
        return state
