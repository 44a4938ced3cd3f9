"""The typed agent events keep the wire shape of the dicts they replaced."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.agent.chunks import Chunk, Citation
from services.agent.events import (
    CitationEvent,
    DoneEvent,
    ErrorEvent,
    ObservationStep,
    ThoughtStep,
    TokenEvent,
    ToolCallStep,
    parse_event,
)


def test_only_set_fields_go_on_the_wire_and_tags_always_do() -> None:
    done = DoneEvent(conversation_id=None, message_id="msg_1", model=None, citations=[], finish_reason="stop")
    assert done.wire() == {
        "type": "done",
        "conversation_id": None,
        "message_id": "msg_1",
        "model": None,
        "citations": [],
        "finish_reason": "stop",
    }
    done.usage = {"total_tokens": 3}
    assert done.wire()["usage"] == {"total_tokens": 3} and "grounding" not in done.wire()
    assert ThoughtStep(step=2, text="hmm").wire() == {
        "type": "step",
        "kind": "thought",
        "step": 2,
        "text": "hmm",
    }
    assert ErrorEvent(message="m", code="c").wire() == {"type": "error", "message": "m", "code": "c"}


def test_every_event_reads_back_as_itself() -> None:
    chunk = Chunk(chunk_id="c1", document_id="d1", text="Berlin", start=0, end=6, title="t")
    events = [
        TokenEvent(text="Hi"),
        CitationEvent.from_citation(Citation.of(1, chunk)),
        ToolCallStep(step=1, tool="calculator", input="2+2", repairs=[]),
        ObservationStep(tool="calculator", text="4", ok=True, seconds=0.01),
        DoneEvent(message_id="msg_2", citations=[], finish_reason="length", invalid_citations=[3]),
    ]
    for event in events:
        back = parse_event(event.wire())
        assert type(back) is type(event) and back == event and back.wire() == event.wire()


def test_dict_style_reads_see_the_wire_form() -> None:
    event = ObservationStep(tool="calculator", text="4", ok=False)
    assert event["kind"] == "observation" and event.get("seconds") is None and event.get("ok") is False
    assert event == {"type": "step", "kind": "observation", "tool": "calculator", "text": "4", "ok": False}
    assert event != {"type": "step", "kind": "observation", "tool": "calculator", "text": "5", "ok": False}


def test_an_unknown_type_or_step_kind_is_refused() -> None:
    with pytest.raises(ValidationError):
        parse_event({"type": "tokens", "text": "x"})
    with pytest.raises(ValidationError):
        parse_event({"type": "step", "kind": "dream", "text": "x"})
