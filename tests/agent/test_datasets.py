"""Dataset rows from feedback, on hand-made turn records (no services)."""

from __future__ import annotations

from services.agent.feedback import build_dataset
from services.agent.protocol import TurnRecord
from services.agent.turns import FeedbackRow

PROMPT = [
    {"role": "user", "content": "Sources:\n[1] Staff get 30 days of leave.\n\nQuestion: How much leave?"}
]


def record(message_id: str, completion: str, answer: str, kind: str = "generated") -> TurnRecord:
    return TurnRecord(
        message_id=message_id,
        pipeline="chat-documents",
        model="base",
        prompt=PROMPT,
        completion=completion,
        answer=answer,
        answer_kind=kind,  # type: ignore[arg-type]
        created_at=1.0,
    )


def rating(message_id: str, value: int, correction: str | None = None) -> FeedbackRow:
    return FeedbackRow(message_id, value, correction, None, 1.0, 1.0)


def test_a_rating_trains_on_what_the_user_saw() -> None:
    """An extractive answer (the guard showed source sentences instead of the model's text): its
    thumbs up makes the shown sentences the desirable completion, not the raw text never shown;
    a generated answer trains on the model's own completion."""
    guarded = record(
        "msg_a", "The answer is: The answer is:", "Staff get 30 days of leave [1].", "extractive"
    )
    plain = record("msg_b", "Staff get 30 days [1].", "Staff get 30 days [1].")
    feedback = [
        (rating("msg_a", 1), guarded),
        (rating("msg_b", -1, "Staff get 30 days of leave [1]."), plain),
    ]
    kto = build_dataset("kto", feedback, []).rows
    assert [(r["completion"], r["label"]) for r in kto] == [
        ("Staff get 30 days of leave [1].", True),
        ("Staff get 30 days [1].", False),
        ("Staff get 30 days of leave [1].", True),
    ]
    sft = build_dataset("sft", feedback, []).rows
    assert [r["messages"][-1]["content"] for r in sft] == ["Staff get 30 days of leave [1]."] * 2
    assert all(r["prompt"] == PROMPT for r in kto)
