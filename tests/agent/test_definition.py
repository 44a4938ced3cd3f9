import json
from pathlib import Path

import pytest

from services.agent.pipelines.definition import (
    PipelineDefinitionError,
    build_pipeline,
    load_definition_file,
    load_pipelines,
)


def test_builtin_pipelines_load_in_dependency_order() -> None:
    pipelines = load_pipelines()
    assert {"semantic-search", "chat-documents"} <= set(pipelines)
    order = pipelines["chat-documents"].order
    assert order.index("retrieve") < order.index("prompt") < order.index("generate") < order.index("cite")


def spec(**components: dict) -> dict:  # type: ignore[type-arg]
    return {"name": "p", "kind": "chat", "components": components}


def test_cycle_is_named() -> None:
    data = spec(
        a={"type": "retriever", "after": ["c"]},
        b={"type": "prompt_builder", "after": ["a"]},
        c={"type": "generator", "after": ["b"]},
    )
    with pytest.raises(PipelineDefinitionError, match=r"cycle: a -> c -> b -> a"):
        build_pipeline(data)


def test_unknown_component_type_lists_known_ones() -> None:
    with pytest.raises(PipelineDefinitionError, match=r"unknown type 'vector_magic'.*known: .*retriever"):
        build_pipeline(spec(a={"type": "vector_magic"}))


def test_unknown_dependency_and_bad_params() -> None:
    with pytest.raises(PipelineDefinitionError, match=r"runs after 'nope'"):
        build_pipeline(spec(a={"type": "retriever", "after": ["nope"]}))
    with pytest.raises(PipelineDefinitionError, match=r"component 'a' \(retriever\): mode"):
        build_pipeline(spec(a={"type": "retriever", "params": {"mode": "fuzzy"}}))
    with pytest.raises(PipelineDefinitionError, match=r"top_kk"):
        build_pipeline(spec(a={"type": "retriever", "params": {"top_kk": 3}}))
    with pytest.raises(PipelineDefinitionError, match=r"kind"):
        build_pipeline({"name": "p", "kind": "poem", "components": {"a": {"type": "retriever"}}})


def test_files_yaml_json_and_broken(tmp_path: Path) -> None:
    (tmp_path / "mine.json").write_text(json.dumps(spec(r={"type": "retriever"}) | {"name": "mine"}))
    assert load_definition_file(tmp_path / "mine.json").name == "mine"
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(PipelineDefinitionError, match=r"broken.yaml: not valid YAML"):
        load_definition_file(tmp_path / "broken.yaml")
    with pytest.raises(PipelineDefinitionError, match="does not exist"):
        load_pipelines(tmp_path / "missing")


def test_a_per_request_top_k_reaches_any_retriever_through_the_protocol() -> None:
    """The retrieve node hands the request's ``top_k`` to whatever ``Retriever`` it was built
    with (not only the retrieval service's client), and None when the request names none."""
    import asyncio
    from typing import cast

    from services.agent.chunks import Chunk
    from services.agent.pipelines.components import RetrieveNode
    from services.agent.pipelines.state import RunContext, RunState

    class Recording:
        def __init__(self) -> None:
            self.asked: list[int | None] = []

        async def retrieve(
            self, ctx: RunContext, collection: str, query: str, top_k: int | None = None
        ) -> list[Chunk]:
            self.asked.append(top_k)
            return [Chunk(chunk_id=f"c{i}", document_id="d", text="t", title="T") for i in range(top_k or 10)]

    retriever = Recording()
    node = RetrieveNode(RetrieveNode.P(fetch_titles=False), retriever)

    async def run(options: dict[str, int]) -> RunState:
        state = RunState(question="q", collection="kb", options=options)
        async for _ in node.run(state, cast(RunContext, None)):  # this retriever needs no context
            pass
        return state

    assert len(asyncio.run(run({"top_k": 3})).chunks) == 3
    assert len(asyncio.run(run({})).chunks) == 10
    assert retriever.asked == [3, None]
