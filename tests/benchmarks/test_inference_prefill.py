"""benchmarks.inference's prefill runs: the long prompts it sends and how it reports them."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from benchmarks.inference.__main__ import chat_ids, long_prompt, print_prefill
from tests.helpers.models import smollm2_dir


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.mark.parametrize("tokens", [300, 1500])
def test_a_long_prompt_is_the_asked_length_and_its_text_makes_its_ids(tokenizer: Any, tokens: int) -> None:
    text, ids = long_prompt(tokenizer, tokens, 7)
    # decoding and re-tokenising may merge a few tokens at the cut
    assert abs(len(ids) - tokens) <= 3
    # the server gets the text: its chat prompt is the same ids llama.cpp decodes
    assert chat_ids(tokenizer, text) == ids


def test_long_prompts_differ_right_after_the_template(tokenizer: Any) -> None:
    """No prefix cache may reuse one prompt's body for the next."""
    _, a = long_prompt(tokenizer, 400, 1)
    _, b = long_prompt(tokenizer, 400, 2)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    template = len(chat_ids(tokenizer, ""))
    assert shared <= template + 2


def test_prefill_table_rates_each_round_against_its_own_llama_cpp(capsys: pytest.CaptureFixture[str]) -> None:
    print_prefill(
        [
            ("llama.cpp, round 1", 200.0, None),
            ("tandem torch engine, round 1", 500.0, 200.0),
            ("llama.cpp, round 2", 100.0, None),
            ("tandem torch engine, round 2", 300.0, 100.0),
        ],
        1500,
        3,
    )
    out = capsys.readouterr().out
    assert "| tandem torch engine, round 1 | 500 | 2.50x |" in out
    assert "| tandem torch engine, round 2 | 300 | 3.00x |" in out
    assert "median over rounds | | 2.75x (2.50 / 3.00) |" in out
