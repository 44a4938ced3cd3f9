"""The shipped GSM8K reward: exact match of the ``#### <number>`` answers."""

from __future__ import annotations

import json

from services.trainer.data.formats import PromptRecord, of_kind, parse_dataset
from services.trainer.rewards import get_reward, gsm8k_number, reward_names
from tests.trainer.conftest import GSM8K, head_lines


def test_gsm8k_number_normalises() -> None:
    assert gsm8k_number("so #### 1,234") == "1234"
    assert gsm8k_number("#### 5.0") == "5"
    assert gsm8k_number("#### -3") == "-3"
    assert gsm8k_number("first #### 1 then #### 2") == "2"
    assert gsm8k_number("the answer is 72") is None


def test_gsm8k_exact_match_on_real_rows() -> None:
    rows = [json.loads(x) for x in head_lines(GSM8K, 4).splitlines()]
    records = of_kind(parse_dataset(head_lines(GSM8K, 4)).records, PromptRecord)
    fn = get_reward("gsm8k_exact_match")
    assert "gsm8k_exact_match" in reward_names()
    right = [r["answer"] for r in rows]
    wrong = ["I think #### 999999", "no idea", rows[1]["answer"], ""]
    assert fn(records, right) == [1.0, 1.0, 1.0, 1.0]
    assert fn(records, wrong) == [0.0, 0.0, 0.0, 0.0]
