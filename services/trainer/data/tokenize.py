"""Chat-template tokenisation with the loss on assistant tokens only.

The template is rendered to text once per conversation; each assistant turn's
span is found as the difference between the render of the conversation up to
that turn (with the generation prompt) and the render including it. The whole
text is then tokenised once, and a token is a label only if it starts inside an
assistant span. So the ids are exactly what the model sees at inference time
(the same full-text tokenisation), and the labels cover the assistant content
and its end-of-turn token, nothing of the user's or the system's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.trainer.data.formats import DatasetError, Message

IGNORE = -100


@dataclass
class SFTSample:
    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class PairSample:
    """A DPO pair: the shared prompt once, then each continuation."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


def render(tokenizer: Any, messages: list[Message], *, generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return str(text)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_sft(tokenizer: Any, messages: list[Message]) -> SFTSample:
    full = render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        upto = render(tokenizer, messages[: i + 1])
        if not full.startswith(upto) or not upto.startswith(before):
            raise DatasetError(
                "the tokenizer's chat template does not render conversations prefix by prefix; "
                "cannot tell assistant tokens apart"
            )
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    labels = [IGNORE] * len(ids)
    span_idx = 0
    for t, (start, _end) in enumerate(enc["offset_mapping"]):
        while span_idx < len(spans) and start >= spans[span_idx][1]:
            span_idx += 1
        if span_idx < len(spans) and spans[span_idx][0] <= start < spans[span_idx][1]:
            labels[t] = ids[t]
    return SFTSample(ids, labels)


def tokenize_prompt(tokenizer: Any, prompt: list[Message]) -> list[int]:
    return encode(tokenizer, render(tokenizer, prompt, generation_prompt=True))


def tokenize_continuations(
    tokenizer: Any, prompt: list[Message], conts: dict[str, list[Message]]
) -> tuple[list[int], list[list[int]]]:
    """The prompt with the generation prompt, then each continuation tokenised on its own.

    The cut sits right after ``<|im_start|>assistant\\n``-style tags, a boundary the
    tokenizer never merges across, so prompt+continuation equals the full render.
    """
    head = render(tokenizer, prompt, generation_prompt=True)
    out = []
    for name, cont in conts.items():
        full = render(tokenizer, prompt + cont)
        if not full.startswith(head):
            raise DatasetError(f"the chat template renders prompt+{name} without the prompt as its prefix")
        out.append(encode(tokenizer, full[len(head) :]))
    return encode(tokenizer, head), out


def tokenize_pair(
    tokenizer: Any, prompt: list[Message], chosen: list[Message], rejected: list[Message]
) -> PairSample:
    head, (c, r) = tokenize_continuations(tokenizer, prompt, {"chosen": chosen, "rejected": rejected})
    return PairSample(head, c, r)


@dataclass
class KTOSample:
    """A KTO row: its prompt and completion, and whether the completion is desirable."""

    prompt: list[int]
    completion: list[int]
    label: bool


def tokenize_kto(tokenizer: Any, prompt: list[Message], completion: list[Message], label: bool) -> KTOSample:
    head, (c,) = tokenize_continuations(tokenizer, prompt, {"completion": completion})
    return KTOSample(head, c, label)
