"""The torch engine as a library: greedy equals transformers' generate, alone and in a
full batch; seeds; stop; n; the trainer's generate_batch contract on a changing model."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from services.inference.engine import SamplingParams, TorchEngine
from services.inference.engine.scheduler_engine import in_own_thread
from tests.helpers.waiting import ManualClock

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three fruits.",
    "hi",
    "Tell me a long story about a dragon and a knight who become friends, with many details.",
]


def _load(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok


def _chat(tok: Any, q: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _reference(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    refs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
        refs.append(out[0, len(p) :].tolist())
    return refs


@pytest.fixture(scope="module")
def lively(lively_tiny_path: Path) -> tuple[Any, Any]:
    return _load(lively_tiny_path)


def test_greedy_equals_generate_alone_and_in_full_batch(lively: tuple[Any, Any]) -> None:
    model, tok = lively
    prompts = [_chat(tok, q) for q in QUESTIONS] + [list(range(300, 340))]
    refs = _reference(model, prompts, 48)
    assert len({tuple(r) for r in refs}) == len(refs), "the reference outputs should differ"
    # full batch (7 prompts in 4 slots: sequences join as others leave), small prefill chunks
    engine = TorchEngine.from_model(model, tok, max_batch_size=4, prefill_chunk=32)
    outs = engine.generate_batch(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    for ref, out in zip(refs, outs, strict=True):
        assert out.token_ids == ref
        assert out.prompt_token_ids
        assert len(out.logprobs) == len(out.token_ids)
        assert all(lp <= 0 for lp in out.logprobs)
    alone = engine.generate_batch([prompts[1]], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert alone[0].token_ids == refs[1]
    assert alone[0].logprobs == outs[1].logprobs, "a row's numbers must not depend on the others"


@pytest.mark.e2e
def test_greedy_equals_generate_smollm2(smollm2_path: Path) -> None:
    model, tok = _load(smollm2_path)
    prompts = [_chat(tok, q) for q in QUESTIONS[:4]]
    refs = _reference(model, prompts, 24)
    engine = TorchEngine.from_model(model, tok, max_batch_size=16)
    outs = engine.generate_batch(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.token_ids for o in outs] == refs
    assert outs[0].text == "The capital of France is Paris."
    assert outs[0].finish_reason == "stop"


def test_seed_n_stop_and_logprobs(lively: tuple[Any, Any]) -> None:
    model, tok = lively
    engine = TorchEngine.from_model(model, tok, max_batch_size=8)
    prompts = [_chat(tok, q) for q in QUESTIONS[:3]]
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, max_tokens=20, seed=11, ignore_eos=True)
    a = engine.generate_batch(prompts[:1], params)
    b = engine.generate_batch(prompts, params)  # other sequences in the batch change nothing
    assert a[0].token_ids == b[0].token_ids
    other = engine.generate_batch(prompts[:1], SamplingParams(**{**params.__dict__, "seed": 12}))
    assert other[0].token_ids != a[0].token_ids
    several = engine.generate_batch(prompts[:2], SamplingParams(**{**params.__dict__, "n": 3}))
    assert len(several) == 6
    assert len({tuple(o.token_ids) for o in several[:3]}) == 3
    # the logprob reported is the model's: recompute it with a plain forward
    out = engine.generate_batch(prompts[:1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    with torch.no_grad():
        full = torch.tensor([out.prompt_token_ids + out.token_ids])
        logp = torch.log_softmax(model(full).logits[0].float(), -1)
    for k, (tid, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert abs(logp[len(out.prompt_token_ids) - 1 + k, tid].item() - lp) < 1e-4
    # a stop token ends the sequence (and is its last token)
    ids = out.token_ids
    stopped = engine.generate_batch(
        prompts[:1], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[ids[2]])
    )[0]
    assert stopped.token_ids == ids[: ids.index(ids[2]) + 1]
    assert stopped.finish_reason == "stop"
    # a stop string cuts the text before it
    full_text = engine.generate_batch(
        prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )[0].text
    stop = full_text[10:14]
    cut = engine.generate_batch(
        prompts[:1], SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full_text[: full_text.index(stop)]


def test_generate_batch_follows_weight_updates(lively: tuple[Any, Any]) -> None:
    """The trainer changes the weights between rollouts: the engine must use the new ones."""
    import copy

    model, tok = lively
    model = copy.deepcopy(model)
    engine = TorchEngine.from_model(model, tok, max_batch_size=4)
    prompt = [_chat(tok, QUESTIONS[0])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = engine.generate_batch(prompt, params)[0].token_ids
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    model.train()
    after = engine.generate_batch(prompt, params)[0].token_ids
    assert after != before
    assert after == _reference(model.eval(), prompt, 12)[0]


def test_long_prompts_and_finished_rows_moved_keep_outputs_equal_to_generate(lively: tuple[Any, Any]) -> None:
    """Prompts of 300-420 tokens in a slab that holds the context from the start; sequences
    finishing at different times move the last row into their hole. Outputs stay equal to
    generate."""
    model, tok = lively
    prompts = [list(range(1000 + 7 * i, 1000 + 7 * i + 300 + 40 * i)) for i in range(4)]
    lengths = [5, 30, 12, 25]
    refs = []
    for p, n in zip(prompts, lengths, strict=True):
        out = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        refs.append(out[0, len(p) :].tolist())
    engine = TorchEngine.from_model(model, tok, max_batch_size=3, prefill_chunk=128)
    outs = [
        engine.generate_batch([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        for p, n in zip(prompts[:1], lengths[:1], strict=True)
    ]
    # all together, each with its own length: rows leave at different steps
    import threading

    engine.scheduler.start()
    try:
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            params = SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
            results[i] = engine.generate_batch([prompts[i]], params)[0].token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        engine.scheduler.stop()
    assert outs[0].token_ids == refs[0]
    assert [results[i] for i in range(4)] == refs
    assert engine.runner.cache.capacity >= 512 and engine.runner.cache.lazy


def test_each_step_is_one_forward_mixing_decode_and_prompt_chunks(lively: tuple[Any, Any]) -> None:
    """A long prompt arriving mid-generation is prefilled in chunks of at most prefill_chunk
    tokens, each in the same forward as the running stream's next token: the running stream
    gets a token at every step (no stall), and both outputs equal generate."""
    from collections import Counter

    from services.inference.engine.scheduler import Sequence

    model, tok = lively
    first, long = _chat(tok, QUESTIONS[4]), list(range(500, 570))
    refs = _reference(model, [first, long], 10)
    engine = TorchEngine.from_model(model, tok, max_batch_size=4, prefill_chunk=32, prefix_cache_mb=0)
    sched = engine.scheduler
    forwards: list[tuple[int, int, int]] = []  # (step, decode tokens, prompt tokens)
    real_forward = engine.runner.forward

    def counting(decode: list[Any], prefill: list[Any]) -> Any:
        forwards.append((sched.steps, len(decode), sum(len(r.token_ids) for r in prefill)))
        return real_forward(decode, prefill)

    engine.runner.forward = counting  # type: ignore[method-assign]
    steps: dict[int, list[int]] = {0: [], 1: []}
    tokens: dict[int, list[int]] = {0: [], 1: []}

    def sink(i: int) -> Any:
        def put(ev: Any) -> None:
            if ev.token_ids:
                steps[i].append(sched.steps)
                tokens[i].extend(ev.token_ids)

        return put

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sched.submit([Sequence("a", 0, first, params, 10, sink(0), None, None)])
    while len(tokens[0]) < 2:
        sched.step()
    sched.submit([Sequence("b", 0, long, params, 10, sink(1), None, None)])
    sched.run_until_done()

    assert tokens[0] == refs[0] and tokens[1] == refs[1]
    assert set(Counter(step for step, _, _ in forwards).values()) == {1}, forwards
    long_chunks = [(d, p) for _, d, p in forwards if p and d]
    assert long_chunks == [(1, 32), (1, 32), (1, 6)], forwards
    assert steps[0] == list(range(steps[0][0], steps[0][0] + 10)), f"the running stream stalled: {steps}"


def _idle_scheduler(lively: tuple[Any, Any], max_batch_size: int = 8) -> tuple[Any, ManualClock]:
    """An engine with a 100 ms admission window on a clock the test moves."""
    model, tok = lively
    engine = TorchEngine.from_model(
        model, tok, max_batch_size=max_batch_size, prefix_cache_mb=0, admit_window=0.1
    )
    clock = ManualClock()
    engine.scheduler.clock = clock
    return engine.scheduler, clock


def _arrivals(sched: Any, clock: ManualClock, tok: Any, times: list[float], sink: Any = None) -> None:
    """One request now (it wakes the idle engine) and one more at each of ``times``."""
    from services.inference.engine.scheduler import Sequence

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def submit(i: int) -> None:
        q = QUESTIONS[i % len(QUESTIONS)]
        sched.submit(
            [
                Sequence(
                    f"t{i}", 0, _chat(tok, q), params, 2, sink(i) if sink else (lambda ev: None), None, None
                )
            ]
        )

    submit(0)
    for i, t in enumerate(times, start=1):
        clock.at(t, lambda i=i: submit(i))


def _gather(sched: Any) -> None:
    with sched._cv:
        sched._gather_burst()


@pytest.mark.parametrize(
    ("times", "gathered", "closed_at"),
    [
        # 60 ms apart: longer than one window in all, never a 100 ms gap
        ([0.06, 0.12, 0.18], 4, 0.28),
        # a 140 ms gap closes the window: the last one waits for the next step
        ([0.06, 0.2], 2, 0.16),
        # arrivals every 90 ms forever: gathering stops at ADMIT_MAX_WINDOWS windows
        ([0.09 * k for k in range(1, 20)], 6, 0.5),
        # nothing more arrives: the window closes after 100 ms
        ([], 1, 0.1),
    ],
)
def test_admission_window(
    lively: tuple[Any, Any], times: list[float], gathered: int, closed_at: float
) -> None:
    from services.inference.engine.scheduler import ADMIT_MAX_WINDOWS

    assert ADMIT_MAX_WINDOWS == 5
    sched, clock = _idle_scheduler(lively)
    _arrivals(sched, clock, lively[1], times)
    _gather(sched)
    assert len(sched.waiting) == gathered
    assert clock.now() == pytest.approx(closed_at)


def test_admission_window_ends_when_the_batch_is_full(lively: tuple[Any, Any]) -> None:
    sched, clock = _idle_scheduler(lively, max_batch_size=3)
    _arrivals(sched, clock, lively[1], [0.01, 0.02, 0.03, 0.04])
    _gather(sched)
    assert len(sched.waiting) == 3 and clock.now() == pytest.approx(0.02)


def test_idle_engine_gathers_a_trickling_burst(lively: tuple[Any, Any]) -> None:
    """Requests arriving 60 ms apart, through the scheduler's own thread, are prefilled in
    its first step (their first tokens come in one step)."""
    import threading

    sched, clock = _idle_scheduler(lively)
    first: dict[int, int] = {}
    done = threading.Event()

    def sink(i: int) -> Any:
        def on(ev: Any) -> None:
            first.setdefault(i, sched.steps)
            if ev.finish_reason and len(first) == 4:
                done.set()

        return on

    _arrivals(sched, clock, lively[1], [0.06, 0.12, 0.18], sink)
    sched.start()
    try:
        assert done.wait(60)
    finally:
        sched.stop()
    assert clock.pending == 0 and clock.now() == pytest.approx(0.28)
    assert len(set(first.values())) == 1, f"first tokens came in different steps: {first}"


def test_sliding_window_model_is_served_past_its_window(tmp_path: Path) -> None:
    """A model with a sliding window is served with its whole context: its layers attend only
    their window (``layer_ops``' window), and greedy output past the window equals generate."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    from tests.helpers.models import small_decoder, smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    config = MistralConfig(**small_decoder(len(tok), max_positions=512), sliding_window=16)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    engine = TorchEngine.from_model(model, tok, max_batch_size=2)
    assert engine.max_model_len == 512
    prompt = list(range(500, 530))
    out = engine.generate_batch([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_torch_setup_work_runs_on_a_thread_that_ends() -> None:
    """``in_own_thread`` (engine build, packing, adapter loads): the result or the exception comes
    back to the awaiting task, and the thread that ran the torch work (and holds its OpenMP pool,
    which would slow the scheduler thread's forwards) is gone afterwards, unlike an executor
    thread of ``asyncio.to_thread``."""
    ran_on: list[threading.Thread] = []

    def work(x: float) -> float:
        ran_on.append(threading.current_thread())
        return float(torch.ones(64, 64).mm(torch.ones(64, 64))[0, 0]) + x

    def fail() -> None:
        raise ValueError("adapter 'a': no adapter_config.json")

    async def run() -> float:
        result = await in_own_thread(work, 1.0)
        with pytest.raises(ValueError, match=r"no adapter_config\.json"):
            await in_own_thread(fail)
        return result

    assert asyncio.run(run()) == 65.0
    assert ran_on[0] is not threading.main_thread()
    ran_on[0].join(10)
    assert not ran_on[0].is_alive()
