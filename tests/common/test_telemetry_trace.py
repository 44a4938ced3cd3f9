"""One chat turn is one trace: the agent over the real retrieval and inference services (in
process, over real HTTP, a tiny random model), every span sent over OTLP/HTTP to a receiver
the test runs; they share one trace id and nest as the calls did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.agent.stack import new_key, real_services
from tests.common.otlp_receiver import ReceivedSpan, otlp_receiver

DOCS = [
    {
        "id": "jupiter",
        "title": "Jupiter",
        "text": "Jupiter is the fifth planet from the Sun and the largest planet in the Solar System.",
    },
    {"id": "honey", "title": "Honey bees", "text": "Honey bees make honey from the nectar of flowers."},
]


def ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[ReceivedSpan]:
    out = []
    while span.parent_id:
        span = by_id[span.parent_id]  # a missing parent is a broken trace: KeyError
        out.append(span)
    return out


def tree(spans: list[ReceivedSpan], parent: str = "", depth: int = 0) -> list[str]:
    """The trace as indented lines (service, span, its attributes), children in start order."""
    out = []
    for s in sorted((s for s in spans if s.parent_id == parent), key=lambda s: s.start_ns):
        attrs = {
            k: v for k, v in s.attributes.items() if not k.startswith(("http.", "net.", "url.", "server."))
        }
        ms = (s.end_ns - s.start_ns) / 1e6
        out.append(f"{'  ' * depth}{s.name} [{s.service}] {ms:.1f} ms {attrs if attrs else ''}".rstrip())
        out += tree(spans, s.span_id, depth + 1)
    return out


def test_a_chat_turn_is_one_trace(
    redis_url: str, tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with otlp_receiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        key = new_key(redis_url, "acme-trace")
        settings: dict[str, Any] = {"tokenizer": str(tiny_model_path), "max_answer_tokens": 8}
        with real_services(redis_url, tmp_path, tiny_model_path, key, DOCS, **settings) as stack:
            stack.run(
                "chat-documents-generate", {"query": "Which planet is the largest?", "collection": "facts"}
            )
        # the services are stopped: each flushed its spans on the way out

    roots = [s for s in receiver.by_service("agent") if s.parent_id == "" and "/run" in s.name]
    assert len(roots) == 1, [s.name for s in receiver.by_service("agent")]
    root = roots[0]
    spans = [s for s in receiver.spans if s.trace_id == root.trace_id]
    by_id = {s.span_id: s for s in spans}
    print("\n" + "\n".join(tree(spans)))
    assert {"agent", "retrieval", "inference"} <= {s.service for s in spans}
    for s in spans:  # every span of the turn hangs from the agent's request span
        assert s is root or ancestors(s, by_id)[-1] is root, s

    search = next(s for s in spans if s.name == "retrieval.search")
    assert search.attributes["mode"] == "hybrid" and search.attributes["hits"] >= 1
    assert search.attributes["top_k"] > 0 and search.attributes["ms"] > 0
    assert by_id[search.parent_id].name == "pipeline.retriever"
    # the retrieval service's request span continues the agent's call (traceparent over HTTP)
    served = next(s for s in spans if s.service == "retrieval" and s.name.endswith("/search"))
    assert search in ancestors(served, by_id)

    prompt = next(s for s in spans if s.name == "pipeline.prompt_builder")
    assert prompt.attributes["tokens"] > 0
    generation = next(s for s in spans if s.name == "generation")
    assert generation.service == "inference"
    assert generation.attributes["gen_ai.usage.output_tokens"] >= 1
    assert generation.attributes["gen_ai.usage.input_tokens"] > 0
    assert generation.attributes["tandem.time_to_first_token_s"] > 0
    assert "tandem.queue_wait_s" in generation.attributes
    assert not [s for s in spans if " http send" in s.name]  # no span per streamed chunk
    generate = next(s for s in spans if s.name == "pipeline.generator")
    assert generate in ancestors(generation, by_id)
    assert generate.attributes["completion_tokens"] == generation.attributes["gen_ai.usage.output_tokens"]
    guard = next(s for s in spans if s.name == "pipeline.groundedness_guard")
    assert guard.attributes["kind"] in ("generated", "extractive", "not_found")
    # the guard judges every answer drawn from sources (a random model's may be ruled not_found)
    if guard.attributes["kind"] != "not_found":
        assert guard.attributes["verdict"], guard.attributes
