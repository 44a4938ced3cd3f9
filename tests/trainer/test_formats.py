"""Dataset formats: every accepted shape normalises, and bad rows are named by line and field."""

from __future__ import annotations

import json

import pytest

from services.trainer.data.formats import (
    ChatRecord,
    DatasetError,
    PreferenceRecord,
    of_kind,
    parse_dataset,
    split_hh_pair,
)
from tests.trainer.conftest import jsonl


def test_alpaca_sharegpt_messages_completion_normalise() -> None:
    cases = {
        "alpaca": {"instruction": "Add", "input": "2+2", "output": "4"},
        "sharegpt": {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        "messages": {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        },
        "completion": {"prompt": "hi", "completion": "hello"},
        "gsm8k": {"question": "1+1?", "answer": "2\n#### 2"},
    }
    for fmt, row in cases.items():
        parsed = parse_dataset(jsonl([row, row]))
        assert parsed.format == fmt
        assert "sft" in parsed.kinds
        rec = parsed.records[0]
        assert isinstance(rec, ChatRecord)
        msgs = rec.messages
        assert msgs[-1]["role"] == "assistant" and msgs[-2]["role"] == "user"
    (alpaca,) = of_kind(parse_dataset(jsonl([cases["alpaca"]])).records, ChatRecord)
    assert alpaca.messages[0]["content"] == "Add\n\n2+2"


def test_preference_strings_and_messages() -> None:
    rows = [
        {"prompt": "q", "chosen": "good", "rejected": "bad"},
        {
            "prompt": [{"role": "user", "content": "q"}],
            "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}],
        },
    ]
    parsed = parse_dataset(jsonl(rows))
    assert parsed.format == "preference" and parsed.kinds == ("dpo",)
    first, second = of_kind(parsed.records, PreferenceRecord)
    assert first.prompt == second.prompt
    assert second.chosen == [{"role": "assistant", "content": "good"}]


def test_hh_rlhf_splits_at_last_shared_assistant_turn(hh_rows: bytes) -> None:
    chosen = "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: yes indeed"
    rejected = "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: yes no"
    prompt, c, r = split_hh_pair(chosen, rejected)
    assert prompt == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert c == [{"role": "assistant", "content": "yes indeed"}]
    assert r == [{"role": "assistant", "content": "yes no"}]
    parsed = parse_dataset(hh_rows)
    assert parsed.format == "hh-rlhf"
    for rec, raw in zip(of_kind(parsed.records, PreferenceRecord), hh_rows.splitlines(), strict=True):
        row = json.loads(raw)
        assert rec.prompt[-1]["role"] == "user"
        # prompt + answer gives back the original dialogue's last answer
        assert row["chosen"].rstrip().endswith(rec.chosen[0]["content"])
        assert row["rejected"].rstrip().endswith(rec.rejected[0]["content"])


@pytest.mark.parametrize(
    ("data", "needle", "line", "field"),
    [
        (b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": \n', "malformed JSON", 2, None),
        (
            b'{"instruction": "a", "output": "b"}\n\n{"instruction": "a"}\n',
            "field 'output' is missing",
            3,
            "output",
        ),
        (b'{"messages": [{"role": "robot", "content": "x"}]}\n', "messages[0].role", 1, "messages[0].role"),
        (b'{"prompt": "q", "chosen": "a", "rejected": 3}\n', "rejected", 1, "rejected"),
        (b"[1, 2]\n", "JSON object", 1, None),
        (b'{"foo": 1}\n', "unrecognised row", 1, None),
        (b"\n\n", "empty", None, None),
    ],
)
def test_bad_rows_name_line_and_field(data: bytes, needle: str, line: int | None, field: str | None) -> None:
    with pytest.raises(DatasetError) as err:
        parse_dataset(data)
    assert needle in str(err.value)
    assert err.value.line == line
    if line is not None:
        assert f"line {line}" in str(err.value)
    if field is not None:
        assert err.value.field == field


def test_sft_needs_an_assistant_message() -> None:
    with pytest.raises(DatasetError, match="no assistant message"):
        parse_dataset(jsonl([{"messages": [{"role": "user", "content": "hi"}]}]), kind="sft")
