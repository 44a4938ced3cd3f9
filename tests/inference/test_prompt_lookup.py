"""Prompt-lookup decoding (``engine/prompt_lookup.py``): the n-gram lookup on written sentences, and
drafts verified in the scheduler's batched forward without changing the output: greedy tokens and
log-probabilities the same as without drafts, alone and with sequences joining and leaving the batch,
on the eager forward, the lean forward's Python loop and its C++ loop, with a LoRA adapter; sampled
tokens from the model's own distribution (a chi-square test), and the same tokens for a seed."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.inference.engine import SamplingParams, TorchEngine, native, quantized_linear
from services.inference.engine.plan import plain_head, plan_for
from services.inference.engine.prompt_lookup import NgramIndex, PromptLookup, resolve
from services.inference.engine.ragged import DecodeRow, build_plan
from services.inference.engine.sampling import make_generator
from services.inference.engine.scheduler import Sequence
from services.inference.engine.types import StreamEvent
from services.inference.metrics import EngineCollector, EngineMetrics
from tests.helpers.models import make_lora_adapter

# 1-token n-grams and 4-token drafts: the tiny model's output repeats tokens often enough that most
# steps carry a draft, some accepted and some not
EAGER = PromptLookup(tokens=4, min_ngram=1, max_ngram=3)


def _words(text: str, vocab: dict[str, int]) -> list[int]:
    return [vocab.setdefault(w, len(vocab)) for w in text.split()]


def test_the_longest_earlier_ngram_gives_what_followed_it() -> None:
    vocab: dict[str, int] = {}
    prompt = _words("the cat sat on the mat . the dog sat on the rug .", vocab)
    names = {i: w for w, i in vocab.items()}

    def draft(output: str, tokens: int = 3, limit: int = 8, lo: int = 1, hi: int = 3) -> str:
        index = NgramIndex(prompt, PromptLookup(tokens, lo, hi))
        return " ".join(names[t] for t in index.propose(_words(output, vocab), limit))

    # "the cat" occurred once: what followed it
    assert draft("the cat") == "sat on the"
    # "dog sat on": the 3-gram wins over "sat on" (which last occurred after "dog" too) and "on"
    assert draft("a dog sat on") == "the rug ."
    # "cat sat on": its 3-gram occurred after "the", so the latest "sat on" is not what is taken
    assert draft("the cat sat on", tokens=4) == "the mat . the"
    # "sat on" alone (2-gram): its latest occurrence, after "dog"
    assert draft("we sat on", lo=2, hi=2) == "the rug ."
    # the draft stops at the limit the scheduler gives (max_tokens, the context)
    assert draft("the cat", limit=1) == "sat"
    # nothing before ends like this: no draft (a 1-gram "bird" is unknown, min 2 refuses "." alone)
    assert draft("a bird") == ""
    assert draft("so .", lo=2) == ""


def test_output_tokens_join_the_index_and_a_repeat_near_the_end_takes_its_first_occurrence() -> None:
    vocab: dict[str, int] = {}
    index = NgramIndex(_words("alpha beta", vocab), PromptLookup(3, 2, 2))
    output = _words("gamma delta epsilon", vocab)
    assert index.propose(output, 8) == []
    output += _words("gamma delta", vocab)
    names = {i: w for w, i in vocab.items()}
    # the output's own earlier "gamma delta", found by the index as the output grew
    assert [names[t] for t in index.propose(output, 8)] == ["epsilon", "gamma", "delta"]
    # a run of one word: the latest "go go" is one token before the end (no whole draft after it),
    # so the first occurrence gives the draft
    go = _words("go go go go go", vocab)
    assert NgramIndex(go, PromptLookup(3, 2, 2)).propose([], 8) == go[:3]


def test_a_real_tokenizers_sentence(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    text = "Set max_connections in postgresql.conf, then restart the server. Logs go to pg_log."
    ids = tok.encode(text)
    cut = tok.encode("Set max_connections in")
    assert ids[: len(cut)] == cut
    # the answer so far repeats the prompt's first words: the draft is what followed them there
    index = NgramIndex(ids + tok.encode(" Answer:"), PromptLookup(6, 2, 4))
    assert tok.decode(index.propose(cut, 16)).startswith(" postgres")


def test_resolve_and_settings() -> None:
    assert resolve("off", "cpu") is None
    assert resolve("auto", "cuda") is None
    assert resolve("on", "cuda") == PromptLookup()
    assert resolve("auto", "cpu", EAGER) is EAGER
    # a bound on a step's rows: 3 sequences leave 5 draft tokens, 8 or more none
    bounded = PromptLookup(max_rows=8)
    assert bounded.budget(3) == 5 and bounded.budget(9) == 0
    assert "at most 8 decode rows" in bounded.describe()
    with pytest.raises(ValueError, match=r"1 <= min \(3\) <= max \(2\)"):
        PromptLookup(4, 3, 2)
    from pydantic import ValidationError

    from services.inference.config import InferenceSettings

    with pytest.raises(ValidationError, match="PROMPT_LOOKUP_MIN \\(5\\) must not exceed"):
        InferenceSettings(prompt_lookup_min=5, prompt_lookup_max=3)


def test_decode_tokens_of_one_slot_must_follow_each_other() -> None:
    cpu = torch.device("cpu")
    plan = build_plan([DecodeRow(0, 5, 10), DecodeRow(0, 6, 11), DecodeRow(1, 7, 3)], [], cpu)
    assert plan.decode_gathered and plan.decode_rows is not None
    assert plan.decode_rows.tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="decode tokens of slot 0 must follow each other"):
        build_plan([DecodeRow(0, 5, 10), DecodeRow(0, 6, 12)], [], cpu)


# --- the engine ----------------------------------------------------------------------------------
def _load(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _engine(
    path: Path, path_kind: str, lookup: PromptLookup | None, adapter: Path | None = None
) -> TorchEngine:
    """``eager``: fp32, the Hugging Face modules; ``python``/``native``: int4 decode through the lean
    forward's Python loop / its C++ loop."""
    model, tok = _load(path)
    mode = "on" if lookup is not None else "off"
    if path_kind == "eager":
        engine = TorchEngine.from_model(
            model, tok, max_batch_size=3, prefill_chunk=32, prompt_lookup=mode, prompt_lookup_sizes=lookup
        )
    else:
        native_decode = "on" if path_kind == "native" else "off"
        plan = plan_for(model, quantize="int4", native_decode=native_decode)
        if path_kind == "python":
            plan = dataclasses.replace(plan, decode="python", prompt="reference", head_decode=plain_head())
        assert plan.decode == ("native-own" if path_kind == "native" else "python")
        engine = TorchEngine.from_model(
            model,
            tok,
            max_batch_size=3,
            prefill_chunk=32,
            plan=plan,
            prompt_lookup=mode,
            prompt_lookup_sizes=lookup,
        )
    if adapter is not None:
        engine.load_adapter_sync("a", str(adapter))
    return engine


@dataclasses.dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    arrives: int  # the step before which it is submitted
    adapter: str | None = None
    seed: int | None = None
    params: SamplingParams = dataclasses.field(
        default_factory=lambda: SamplingParams(temperature=0, ignore_eos=True)
    )


def _run(engine: TorchEngine, jobs: list[Job]) -> list[tuple[list[int], list[float]]]:
    """Each job's tokens and log-probabilities, the jobs arriving at their steps (so sequences join
    a running batch and leave it at different times)."""
    sched = engine.scheduler
    seqs: list[Sequence] = []
    events: list[list[StreamEvent]] = [[] for _ in jobs]
    step = 0
    while step == 0 or sched.has_work() or any(j.arrives >= step for j in jobs):
        arriving = [(i, j) for i, j in enumerate(jobs) if j.arrives == step]
        for i, job in arriving:
            params = dataclasses.replace(job.params, max_tokens=job.max_tokens, seed=job.seed)
            seq = Sequence(
                request_id=f"r{i}",
                index=i,
                prompt_ids=list(job.prompt),
                params=params,
                max_tokens=job.max_tokens,
                sink=events[i].append,
                generator=make_generator(job.seed, engine.device) if params.temperature > 0 else None,
                detok=None,
                adapter=job.adapter,
            )
            seqs.append(seq)
            sched.submit([seq], bounded=False)
        sched.step()
        step += 1
        assert step < 2000
    out = []
    for seq, evs in zip(sorted(seqs, key=lambda s: s.index), events, strict=True):
        assert [t for ev in evs for t in ev.token_ids] == seq.output_ids
        assert evs[-1].finish_reason == "length" and len(seq.output_ids) == seq.max_tokens
        out.append((seq.output_ids, seq.logprobs))
    return out


def _jobs(tok: Any, adapter: str | None = None) -> list[Job]:
    text = "Restart the server after you change max_connections. Restart the server, then check the log."
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    ids = tok.encode(chat)
    return [
        Job(ids, 40, 0),
        Job(list(range(300, 340)) * 2, 25, 0, adapter),
        Job(ids[5:] + ids[:5], 30, 3),
        Job([5, 6, 7, 8, 9] * 8, 12, 4, adapter),  # waits for a slot, joins as the others leave
        Job(ids[::2], 20, 9),
    ]


def _native_ok() -> bool:
    return quantized_linear.available("int4", torch.device("cpu")) is None and native.avx2()


@pytest.mark.parametrize(
    ("path_kind", "with_adapter"),
    [("eager", False), ("eager", True), ("python", False), ("native", False), ("native", True)],
)
def test_greedy_output_is_the_same_with_and_without_drafts(
    lively_tiny_path: Path, tmp_path: Path, path_kind: str, with_adapter: bool
) -> None:
    if path_kind != "eager" and not _native_ok():
        pytest.skip("needs torch's CPU int4 kernel and an AVX2 CPU")
    adapter = None
    if with_adapter:
        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        adapter = make_lora_adapter(lively_tiny_path, tmp_path / "lora", seed=5, modules=modules)
    plain = _engine(lively_tiny_path, path_kind, None, adapter)
    drafted = _engine(lively_tiny_path, path_kind, EAGER, adapter)
    assert plain.plan.prompt_lookup == "off" and drafted.plan.prompt_lookup == "ngram"
    if path_kind == "native":
        assert drafted.runner.fused is not None and drafted.runner.fused.native
        # two threads: a draft token's attention may run before the key of the token before it
        # is written unless every key of the step is written first
        torch.set_num_threads(2)
    jobs = _jobs(plain.tokenizer, "a" if with_adapter else None)
    want = _run(plain, jobs)
    steps = plain.scheduler.steps
    got = _run(drafted, jobs)
    # token for token, and the log-probabilities bit for bit: a decode row's numbers are the same
    # whether it is a draft's row or the next step's only one
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a[0] == b[0], i
        assert a[1] == b[1], i
    # the drafts were real: verified, most accepted, at least one not (how many depends on the
    # model's numbers), and fewer steps for it
    stats = drafted.scheduler.lookup_stats
    assert stats.accepted_tokens >= 10 and stats.draft_tokens - stats.accepted_tokens >= 1, stats
    assert drafted.scheduler.steps < steps


def _pit(probs: torch.Tensor, token: int, u: float) -> float:
    """The randomised probability integral transform of ``token`` under ``probs``: uniform on [0, 1)
    when ``token`` is drawn from ``probs``, and independent between positions of a sequence drawn
    token by token (Rosenblatt's transform)."""
    below = float(probs[:token].sum())
    return below + u * float(probs[token])


def test_sampled_tokens_follow_the_models_distribution(lively_tiny_path: Path) -> None:
    """Chi-square goodness of fit of every sampled token after the first (the ones drafts can
    decide), pooled over 240 seeded sequences: each token's PIT under the model's own filtered
    distribution given the tokens before it, in 10 equal bins; uniform under the null. top_k=3
    keeps the choices few, so the sequences repeat themselves and most steps carry a draft.
    Fixed seeds: the test is deterministic; its threshold is the chi-square's 0.999 quantile with
    9 degrees of freedom (27.88). The same seeds also give the same tokens with drafts as without."""
    model, tok = _load(lively_tiny_path)
    prompt = tok.encode("one two three one two three one two")
    params = SamplingParams(temperature=1.0, top_k=3, ignore_eos=True)
    drafted = _engine(lively_tiny_path, "eager", EAGER)
    plain = _engine(lively_tiny_path, "eager", None)
    jobs = [Job(prompt, 8, k // 3, seed=1000 + k, params=params) for k in range(240)]
    got = _run(drafted, jobs)
    stats = drafted.scheduler.lookup_stats
    assert stats.accepted_tokens > 100 and stats.draft_tokens - stats.accepted_tokens > 100, stats
    assert [w[0] for w in _run(plain, jobs[:60])] == [g[0] for g in got[:60]]
    # the model's distribution for every prefix, from transformers' forward over each whole sequence
    gen = torch.Generator().manual_seed(7)
    bins = [0] * 10
    with torch.no_grad():
        full = torch.tensor([prompt + tokens for tokens, _ in got])
        logits = model(full).logits[:, len(prompt) - 1 : -1].float()
    for row, (tokens, _) in enumerate(got):
        for pos in range(1, len(tokens)):
            step = logits[row, pos]
            top = torch.topk(step, 3)
            probs = torch.zeros_like(step).scatter_(0, top.indices, torch.softmax(top.values, -1))
            u = _pit(probs, tokens[pos], float(torch.rand((), generator=gen)))
            bins[min(9, int(u * 10))] += 1
    n = sum(bins)
    chi2 = sum((b - n / 10) ** 2 / (n / 10) for b in bins)
    assert n == 240 * 7
    assert chi2 < 27.88, (chi2, bins)
    assert math.isfinite(chi2)


def test_acceptance_is_a_metric(lively_tiny_path: Path) -> None:
    engine = _engine(lively_tiny_path, "eager", EAGER)
    _run(engine, _jobs(engine.tokenizer)[:2])
    registry = SimpleNamespace(primary=engine, base_name="tiny", resident={}, loads=0)
    families = {
        f.name: f for f in EngineCollector(EngineMetrics(CollectorRegistry()), lambda: registry).collect()
    }
    stats = engine.scheduler.lookup_stats

    def value(name: str) -> float:
        (sample,) = [s for s in families[name].samples if s.labels == {"model_name": "tiny"}]
        return float(sample.value)

    assert stats.draft_tokens > 0
    assert value("vllm:spec_decode_num_drafts") == stats.drafts
    assert value("vllm:spec_decode_num_draft_tokens") == stats.draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens") == stats.accepted_tokens
    assert value("vllm:spec_decode_draft_acceptance_rate") == pytest.approx(
        stats.accepted_tokens / stats.draft_tokens
    )
    # the forward plan names it, with its sizes
    assert engine.plan.as_dict()["prompt_lookup"] == "ngram"
    assert "ngram 1-3, 4 draft tokens" in engine.plan.reasons["prompt_lookup"]
