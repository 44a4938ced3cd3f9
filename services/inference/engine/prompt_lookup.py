"""Prompt-lookup decoding: draft tokens looked up in the sequence's own text, verified in the step's
one batched forward.

A RAG answer copies from its context: names, commands, whole phrases of the retrieved sources. When
the last few tokens of a sequence (its prompt and output so far) already occurred earlier in it, the
tokens that followed them there are a good guess of what comes next. That guess costs no model (vLLM's
``ngram`` method, transformers' prompt lookup): the longest n-gram of ``min_ngram``..``max_ngram``
tokens ending the sequence is looked up, and up to ``tokens`` tokens that followed its latest earlier
occurrence (or its first, when the latest is too near the end for a whole draft) become the draft.

The scheduler then runs the draft tokens as more decode tokens of the same sequence in the step's
forward (one row a token, each at its own position, attending its own sequence's keys up to it), so
one forward gives the logits after the last token and after each draft token. The sequence samples
its next token as always; while that token equals the draft's next one, the draft token was right
(its key and value are already written) and the logits after it give the following token. So a step
emits every accepted draft token plus one; the rest of the draft is dropped (its keys are written
over later).

Why the output does not change:

- **greedy**: each token is the argmax of the logits the sequence would have had without drafts. A
  decode row's numbers depend on that row alone (the engine's batch-invariant kernels and attention,
  ``ragged.py``), so the logits after an accepted draft token are the very logits the next step would
  have computed: the output is the same token for token.
- **sampling**: with a draft that is one token (not a distribution), speculative sampling's rule
  (accept the draft token ``d`` with probability ``min(1, p(d) / q(d))`` = ``p(d)``, else sample from
  ``p`` without ``d``) is exactly "sample ``x ~ p``, accept when ``x == d``": the token is ``p``'s
  either way. The scheduler samples each position with the sequence's own generator, in order, and
  only where the draft held up to it, so a seeded request draws the same numbers as without drafts
  and gives the same tokens.

``NgramIndex`` keeps, per sequence, where each n-gram last ended, updated as tokens arrive, so a
lookup is a few dictionary reads rather than a scan of a 2,000-token prompt at every step.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from services.inference.engine import defaults

if TYPE_CHECKING:
    from services.inference.engine.plan import ForwardPlan

PromptLookupMode = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class PromptLookup:
    """How drafts are made: ``tokens`` draft tokens at most, from an n-gram of ``min_ngram`` to
    ``max_ngram`` tokens ending the sequence (the longest that occurred before wins); ``max_rows``:
    no more draft tokens in a step than keep its decode rows within it (None, the engine's: no
    bound; a library caller may bound a step's rows)."""

    # vLLM leaves these to its users; the defaults were chosen on the answer sets' tuning documents
    # (benchmarks/inference/prompt_lookup.py, benchmarks/RESULTS.md "Prompt-lookup decoding")
    tokens: int = defaults.PROMPT_LOOKUP_TOKENS
    min_ngram: int = defaults.PROMPT_LOOKUP_MIN
    max_ngram: int = defaults.PROMPT_LOOKUP_MAX
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"prompt lookup: tokens must be at least 1, got {self.tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"prompt lookup: n-gram sizes must satisfy 1 <= min ({self.min_ngram}) <= max ({self.max_ngram})"
            )

    def describe(self) -> str:
        rows = "" if self.max_rows is None else f", while a step has at most {self.max_rows} decode rows"
        return f"ngram {self.min_ngram}-{self.max_ngram}, {self.tokens} draft tokens{rows}"

    def budget(self, sequences: int) -> int:
        """Draft tokens a step of ``sequences`` decoding sequences may carry in all."""
        return 1 << 30 if self.max_rows is None else max(0, self.max_rows - sequences)


def resolve(
    mode: PromptLookupMode, device_type: str, lookup: PromptLookup | None = None
) -> PromptLookup | None:
    """The lookup an engine runs with ``mode`` on a ``device_type`` device (None: no drafts).

    ``auto`` drafts on a CPU, where the CPU attention is batch-invariant, so greedy output is
    unchanged, and where it measured faster on the pipeline's answers (benchmarks/RESULTS.md,
    "Prompt-lookup decoding"). On an accelerator the attention is SDPA's, whose numbers depend on the
    rows beside them: drafts would keep the output distribution but not greedy's exact tokens, so
    ``auto`` leaves them off there; ``on`` drafts there too."""
    if mode == "off" or (mode == "auto" and device_type != "cpu"):
        return None
    return lookup or PromptLookup()


def in_plan(plan: ForwardPlan, mode: PromptLookupMode, lookup: PromptLookup | None) -> ForwardPlan:
    """``plan`` naming the prompt lookup the engine runs (``lookup``, resolved from ``mode``) and why."""
    if lookup is not None:
        name, why = "ngram", f"{mode}: {lookup.describe()}, verified in the step's forward"
    elif mode == "off":
        name, why = "off", "off (the setting)"
    else:
        name, why = "off", "auto: off on an accelerator (its attention is not batch-invariant)"
    reasons = types.MappingProxyType({**plan.reasons, "prompt_lookup": why})
    return dataclasses.replace(plan, prompt_lookup=name, reasons=reasons)


class NgramIndex:
    """One sequence's tokens and, for every n-gram of the lookup's sizes, the position right after
    its latest and its first occurrence (its continuation). ``propose`` extends the index with the tokens that
    arrived since the last call, then looks the sequence's ending up."""

    def __init__(self, prompt: list[int], lookup: PromptLookup) -> None:
        self.lookup = lookup
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        # n-gram -> index of the token that followed its latest / its first occurrence
        self.after: dict[tuple[int, ...], int] = {}
        self.first: dict[tuple[int, ...], int] = {}
        # n-grams ending before this index are in ``after``
        self.indexed = 0

    def _extend(self, output: list[int]) -> None:
        seen = len(self.tokens) - self.prompt_len
        if len(output) > seen:
            self.tokens.extend(output[seen:])
        tokens, lo, hi = self.tokens, self.lookup.min_ngram, self.lookup.max_ngram
        # every n-gram ending before the last token: the ending itself must find an earlier one
        last = len(tokens) - 1
        for end in range(self.indexed, last):
            for n in range(lo, min(hi, end + 1) + 1):
                gram = tuple(tokens[end - n + 1 : end + 1])
                self.after[gram] = end + 1
                self.first.setdefault(gram, end + 1)
        self.indexed = max(self.indexed, last)

    def propose(self, output: list[int], limit: int) -> list[int]:
        """Up to ``limit`` draft tokens after the sequence ``prompt + output`` (``output``: the
        sequence's output so far, which only grows); [] when its ending occurred nowhere before."""
        self._extend(output)
        if limit <= 0:
            return []
        tokens = self.tokens
        size = len(tokens)
        want = min(limit, self.lookup.tokens)
        for n in range(min(self.lookup.max_ngram, size), self.lookup.min_ngram - 1, -1):
            gram = tuple(tokens[size - n :])
            start = self.after.get(gram)
            if start is not None:
                # the latest occurrence (the nearest context), unless it is too close to the end to
                # have a whole draft after it (a repeat in the output): then the first
                if start + want > size:
                    start = self.first[gram]
                return tokens[start : start + want]
        return []


@dataclass
class LookupStats:
    """Counters since start (vLLM's ``spec_decode`` metrics): steps in which a sequence verified a
    draft, draft tokens verified, and those accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
