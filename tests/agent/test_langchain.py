"""LangChain: Tandem tools as BaseTool, the retrieval client as BaseRetriever, a Runnable as a pipeline
component (here the retriever itself, then a RunnableLambda writing the answer)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import BaseTool

from services.agent.clients import InferenceClient, RetrievalClient
from services.agent.config import AgentSettings
from services.agent.langchain_compat import TandemRetriever, as_langchain_tool
from services.agent.pipelines.definition import build_pipeline
from services.agent.pipelines.state import RunContext, RunState
from services.agent.tokens import EstimatingCounter
from services.agent.tools.base import ToolContext
from services.agent.tools.calculator import Calculator
from services.agent.tools.search import DocumentSearch
from services.common.errors import NotFound
from tests.agent.doubles import FailingTool, FakeCorpus, retrieval_double
from tests.agent.stack import CORPUS
from tests.helpers.servers import serve_app

pytestmark = pytest.mark.anyio

# Pipeline components are named by import path in definitions; the fixture fills these in.
RUNNABLES = SimpleNamespace(
    retriever=None,
    summarise=RunnableLambda(
        lambda state: f"{len(state['chunks'])} chunks, best from {state['chunks'][0]['title']}"
    ),
)


@pytest.fixture(scope="module")
def retrieval_url() -> Iterator[str]:
    with serve_app(retrieval_double(FakeCorpus({k: dict(v) for k, v in CORPUS.items()}))) as url:
        yield url


async def test_tools_are_langchain_base_tools(retrieval_url: str) -> None:
    calc = as_langchain_tool(Calculator())
    assert isinstance(calc, BaseTool) and calc.name == "calculator" and "expression" in calc.args
    assert calc.invoke({"expression": "6 * 7"}) == "42"
    assert await calc.ainvoke({"expression": "2^5"}) == "32"
    search = as_langchain_tool(
        DocumentSearch(), ToolContext(retrieval=RetrievalClient(retrieval_url, "k"), collection="geo")
    )
    assert "[de]" in search.invoke({"query": "Berlin capital"})  # an async tool through the sync API
    assert "ValueError: nope" in await as_langchain_tool(FailingTool("boom", ValueError("nope"))).ainvoke(
        {"input": "x"}
    )


async def test_retrieval_client_is_a_langchain_retriever(retrieval_url: str) -> None:
    retriever = TandemRetriever(base_url=retrieval_url, api_key="k", collection="geo", top_k=2)
    assert isinstance(retriever, BaseRetriever)
    docs = retriever.invoke("Eiffel Tower Paris")
    assert docs[0].metadata["document_id"] == "eiffel" and docs[0].metadata["chunk_id"] == "eiffel#0"
    adocs = await retriever.ainvoke("Berlin")
    assert adocs[0].metadata["title"] == "Germany" and adocs[0].metadata["end"] > 0
    with pytest.raises(NotFound):
        TandemRetriever(base_url=retrieval_url, api_key="k", collection="nope").invoke("x")


async def test_runnables_as_pipeline_components(retrieval_url: str) -> None:
    RUNNABLES.retriever = TandemRetriever(base_url=retrieval_url, api_key="k", collection="geo", top_k=3)
    pipeline = build_pipeline(
        {
            "name": "lc",
            "kind": "chat",
            "components": {
                "fetch": {
                    "type": "langchain_runnable",
                    "params": {
                        "target": f"{__name__}:RUNNABLES.retriever",
                        "field": "chunks",
                        "input": "question",
                    },
                },
                "answer": {
                    "type": "langchain_runnable",
                    "after": ["fetch"],
                    "params": {"target": f"{__name__}:RUNNABLES.summarise", "field": "answer"},
                },
            },
        }
    )
    ctx = RunContext(
        AgentSettings(),
        RetrievalClient(retrieval_url, "k"),
        InferenceClient("http://127.0.0.1:9", "k"),
        EstimatingCounter(),
        "none",
    )
    state = RunState(question="capital of Germany Berlin", collection="geo")
    events = [e async for e in pipeline.run(state, ctx)]
    assert state.chunks[0].document_id == "de"
    assert events == [{"type": "token", "text": "2 chunks, best from Germany"}]


def test_runnable_target_errors_are_definition_errors() -> None:
    from services.agent.pipelines.definition import PipelineDefinitionError

    for target, needle in [
        ("nodots", "must look like"),
        ("tests.nothere:x", "cannot import"),
        ("json:dumps", "not a LangChain Runnable"),
    ]:
        with pytest.raises(PipelineDefinitionError, match=needle):
            build_pipeline(
                {
                    "name": "x",
                    "kind": "chat",
                    "components": {
                        "a": {"type": "langchain_runnable", "params": {"target": target, "field": "answer"}}
                    },
                }
            )
