import json
from pathlib import Path
from typing import Any

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
            self, ctx: RunContext, collection: str, query: str, top_k: int | None = None, reader: str = ""
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


def test_a_component_that_needs_what_no_earlier_one_writes_is_refused() -> None:
    """A generator with no prompt builder before it, or a reranker that nothing feeds chunks,
    is a definition error naming the component, the slot and the node type that writes it."""
    with pytest.raises(
        PipelineDefinitionError, match=r"'gen' \(generator\) needs 'plan'.*written by: prompt_builder"
    ):
        build_pipeline(spec(r={"type": "retriever"}, gen={"type": "generator", "after": ["r"]}))
    # written in the pipeline, but by a component it does not run after: order is not defined
    with pytest.raises(PipelineDefinitionError, match=r"'rr' \(overlap_reranker\) needs 'chunks'") as caught:
        build_pipeline(spec(r={"type": "retriever"}, rr={"type": "overlap_reranker"}))
    assert caught.value.param == "components.rr.after"
    # through another component counts
    built = build_pipeline(
        spec(
            r={"type": "retriever"},
            p={"type": "prompt_builder", "after": ["r"]},
            g={"type": "generator", "after": ["p"]},
            c={"type": "citation_resolver", "after": ["g"]},
        )
    )
    assert built.order == ["r", "p", "g", "c"]


def test_every_state_field_is_an_input_or_a_declared_slot() -> None:
    """A new field of the run state must be classified, or no component could declare it."""
    import dataclasses

    from services.agent.pipelines.state import INPUTS, SLOTS, RunState

    fields = {f.name for f in dataclasses.fields(RunState)}
    assert fields == INPUTS | set(SLOTS)
    assert not INPUTS & set(SLOTS)


def test_each_builtin_component_declares_only_slots_of_the_state() -> None:
    from services.agent.pipelines.components import NODE_TYPES
    from services.agent.pipelines.state import SLOTS

    for name, (_, make) in NODE_TYPES.items():
        if name == "langchain_runnable":
            continue  # its sockets depend on its params (checked below)
        sockets = make.sockets  # type: ignore[attr-defined]
        assert sockets.writes and set(sockets.reads) | set(sockets.writes) <= set(SLOTS), name
        assert sockets.needs <= sockets.reads, name


def test_a_component_that_writes_an_undeclared_slot_fails_its_run() -> None:
    """The run checks each component's writes against its sockets: a rewriter that also sets
    the answer is a bug reported by name, not a surprise three components later."""
    import asyncio
    from typing import cast

    from services.agent.pipelines.components import NODE_TYPES, Params, register_node_type
    from services.agent.pipelines.state import RunContext, RunState, Sockets, UndeclaredWrite

    class Sloppy:
        sockets = Sockets.of(writes=("search_query",))

        class P(Params):
            pass

        def __init__(self, p: P) -> None:
            pass

        async def run(self, state: RunState, ctx: RunContext):  # type: ignore[no-untyped-def]
            state.search_query = "rewritten"
            state.chunks.append(cast(Any, "a chunk"))
            return
            yield

    register_node_type("sloppy_rewriter", Sloppy.P, Sloppy)
    try:
        pipeline = build_pipeline(spec(s={"type": "sloppy_rewriter"}))

        async def run() -> None:
            async for _ in pipeline.run(RunState(question="q", collection=None), cast(RunContext, None)):
                pass

        with pytest.raises(UndeclaredWrite, match=r"'s' \(sloppy_rewriter\) wrote chunks"):
            asyncio.run(run())
    finally:
        NODE_TYPES.pop("sloppy_rewriter")


def test_the_docs_list_each_component_s_sockets_as_declared() -> None:
    import re

    from services.agent.pipelines.components import NODE_TYPES

    table = Path(__file__).parents[2].joinpath("docs/agent.md").read_text(encoding="utf-8")
    documented = {
        m.group(1): (m.group(2), m.group(4))
        for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", table, re.MULTILINE)
    }

    def listed(cell: str) -> set[str]:
        return set(re.findall(r"`(\w+)`", cell))

    for name, (_, make) in NODE_TYPES.items():
        if name == "langchain_runnable":
            continue
        needs, writes = documented[name]
        assert listed(needs) == set(make.sockets.needs), name  # type: ignore[attr-defined]
        assert listed(writes) == set(make.sockets.writes), name  # type: ignore[attr-defined]
