"""Continuous batching: sequences join the running batch between steps and leave when done.

One iteration (``step``) does, in order:

1. drop aborted and timed-out sequences (freeing their slots at once);
2. admit waiting sequences into free slots, round-robin over tenants (FIFO within a
   tenant; a tenant already holding its fair share of slots waits while another tenant
   has work), starting each from the longest cached prefix of its prompt;
3. one forward for the whole batch: a token for every running sequence plus prompt
   chunks of newly admitted ones, up to ``prefill_chunk`` prompt tokens (FIFO; a long
   prompt is split over several steps, so a big arrival never stalls the others for
   long). Running streams keep moving while prompts are prefilled, and a step costs one
   read of the weights however it is mixed. A sequence whose prompt is done samples its
   first token in the same step. With prompt lookup (``prompt_lookup.py``) a running
   sequence also carries draft tokens looked up in its own text, as more decode tokens of
   its slot; it emits every draft token its own sampling confirms, plus one.

Each sampled token is handed to the sequence's sink at once (streaming). The scheduler
is driven either by its own thread (the server: ``start()``) or inline by the caller
(``run_until_done``, used by ``generate_batch`` when no thread runs). It drives any
``Runner`` (``runner_protocol.py``): the torch ``ModelRunner`` or llama.cpp's.

The thread's health is measured, not assumed (``check``): it records a heartbeat after
every iteration, so work that has waited longer than ``stall_after`` for a step to finish
says the loop is stuck; a loop that died (an exception a step does not survive) ends
every sequence with an error and refuses new ones.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from services.inference.engine import defaults
from services.inference.engine.detokenizer import IncrementalDetokenizer
from services.inference.engine.kv_cache import SlabKVCache
from services.inference.engine.prefix_cache import PrefixCache, common_prefix_len
from services.inference.engine.prompt_lookup import LookupStats, NgramIndex, PromptLookup
from services.inference.engine.ragged import DecodeRow, PrefillRow, adapter_key
from services.inference.engine.runner_protocol import Runner
from services.inference.engine.sampling import RowSampling, sample
from services.inference.engine.types import (
    EngineUnavailable,
    FinishReason,
    QueueFull,
    SamplingParams,
    StreamEvent,
    TokenLogprob,
    TopLogprob,
)

log = logging.getLogger("tandem.engine.scheduler")

Sink = Callable[[StreamEvent], None]
# An idle engine gathers a burst for at most this many admission windows.
ADMIT_MAX_WINDOWS = 5
# Sequences submitted without a tenant (the trainer's in-process rollouts, tests) share this one.
DEFAULT_TENANT = "_default"
_ids = itertools.count()


class Clock(Protocol):
    """Time as the admission window and the loop's heartbeat see it: tests pass a clock they
    advance by hand, so no test sleeps against the window or the stall bound."""

    def now(self) -> float: ...

    def wait(self, cv: threading.Condition, timeout: float) -> None:
        """Block on ``cv`` (held by the caller) until notified or ``timeout`` seconds pass."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def wait(self, cv: threading.Condition, timeout: float) -> None:
        cv.wait(timeout)


@dataclass
class Sequence:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    sink: Sink
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    adapter: str | None = None
    deadline: float | None = None
    # xgrammar GrammarMatcher of a constrained request (its own per choice)
    matcher: Any = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    slot: int = -1
    finish_reason: FinishReason | None = None
    # looked up in the prefix cache already (only once, when admitted)
    prefix_checked: bool = False
    # time the sequence was submitted / got its first token (metrics)
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # when it got a batch slot (metrics: the queue wait)
    # who the sequence is for: admission is fair between tenants, not between requests
    tenant: str = DEFAULT_TENANT
    # its n-grams, for draft tokens (prompt_lookup.py), made at its first decode step
    ngrams: NgramIndex | None = None

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= len(self.prompt_ids)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def _adapter(seq: Sequence) -> str:
    # prefix-cache entries are keyed like the forward's rows: keys/values depend on the adapter
    return adapter_key(seq.adapter)


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        tokenizer: Any,
        *,
        max_batch_size: int,
        max_queue: int,
        prefill_chunk: int,
        eos_token_ids: set[int],
        model_lock: threading.RLock,
        num_threads: int = 0,
        prefix_cache: PrefixCache | None = None,
        admit_window: float = 0.0,
        tenant_max_queued: int | None = None,
        clock: Clock | None = None,
        stall_after: float = defaults.STALL_S,
        prompt_lookup: PromptLookup | None = None,
    ) -> None:
        """``stall_after``: seconds work may wait for the loop to finish a step before
        ``check`` calls the loop stuck. ``prompt_lookup``: draft tokens looked up in each
        sequence's own text, verified in the step's forward (None: one token a step)."""
        self.prompt_lookup = prompt_lookup
        self.lookup_stats = LookupStats()
        self.clock: Clock = clock or MonotonicClock()
        self.stall_after = stall_after
        # the loop's heartbeat (clock time after its last iteration), and when work last
        # arrived at an idle scheduler: a stall is measured from the later of the two
        self._beat = float("-inf")
        self._work_since = float("-inf")
        # why the loop thread died (None while it lives or never ran)
        self.dead: str | None = None
        # per tenant: sequences that may wait beyond the tenant's fair share of free slots
        # (None: only the global max_queue applies)
        self.tenant_max_queued = tenant_max_queued
        # the tenant admitted last: the round-robin resumes after it
        self._last_tenant: str | None = None
        self.admit_window = admit_window
        self.num_threads = num_threads
        self.prefix_cache = prefix_cache or PrefixCache(0)
        if self.prefix_cache.enabled and runner.prefix_kv is None:
            raise ValueError("a prefix cache needs a runner with a KV slab to copy prefixes from and into")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.prefill_chunk = max(16, prefill_chunk)
        self.eos_token_ids = eos_token_ids
        self.model_lock = model_lock
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence] = []
        self._aborts: set[str] = set()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.steps = 0
        self.last_error: str | None = None

    # --- submission (any thread) ---------------------------------------------------------
    def submit(self, seqs: list[Sequence], *, bounded: bool = True) -> None:
        with self._cv:
            if self.dead is not None:
                # nothing would ever run them: refused, never left waiting forever
                raise EngineUnavailable(f"the engine loop died ({self.dead}); the service needs a restart")
            free = max(0, self.max_batch_size - len(self.slots))
            if bounded and self.tenant_max_queued is not None and seqs:
                self._check_tenant_share(seqs[0].tenant, len(seqs), free)
            if bounded and len(self.waiting) + len(seqs) > self.max_queue + free:
                raise QueueFull(
                    f"the waiting queue is full ({len(self.waiting)} requests waiting, "
                    f"limit {self.max_queue}); retry later",
                    retry_after=1.0,
                )
            if not (self.waiting or self.slots):
                self._work_since = self.clock.now()
            self.waiting.extend(seqs)
            self._cv.notify()

    def _check_tenant_share(self, tenant: str, count: int, free: int) -> None:
        """Refuse a tenant whose waiting sequences (``n`` choices count each) would pass its
        cap plus its fair share of the free slots, so one tenant's flood is that tenant's
        429s and never fills the global queue for everyone. Caller holds ``_cv``."""
        assert self.tenant_max_queued is not None
        tenants = {s.tenant for s in self.waiting} | {s.tenant for s in self.slots} | {tenant}
        share = -(-free // len(tenants))  # ceil: a lone tenant may fill every free slot
        queued = sum(1 for s in self.waiting if s.tenant == tenant)
        if queued + count > self.tenant_max_queued + share:
            raise QueueFull(
                f"tenant {tenant!r} has {queued} sequences waiting and asked for {count} more "
                f"(n counts each); its limit is {self.tenant_max_queued} waiting plus a fair "
                f"share of {share} free slots; retry later",
                retry_after=1.0,
                code="rate_limit_exceeded",
            )

    def _admit(self) -> None:
        """Fill free slots round-robin over the tenants that have waiting sequences (FIFO
        within a tenant). While several tenants compete, one at or above its fair share of
        the batch (``max_batch_size`` / competing tenants) is passed over, so a tenant
        holding many slots cannot take the next free one from a tenant holding few.
        Caller holds ``_cv``."""
        if not self.waiting or len(self.slots) >= self.max_batch_size:
            return
        queues: dict[str, deque[Sequence]] = {}
        for seq in self.waiting:
            queues.setdefault(seq.tenant, deque()).append(seq)
        # tenants in the order their oldest waiting sequence arrived; the round resumes
        # after the tenant admitted last (from the oldest when that one waits no more)
        order = list(queues)
        if self._last_tenant in queues:
            start = order.index(self._last_tenant) + 1
            order = order[start:] + order[:start]
        running: dict[str, int] = {}
        for seq in self.slots:
            running[seq.tenant] = running.get(seq.tenant, 0) + 1
        competing = set(queues) | set(running)
        share = -(-self.max_batch_size // len(competing))
        admitted: set[int] = set()
        capped = len(competing) > 1
        while len(self.slots) < self.max_batch_size:
            progressed = False
            for tenant in order:
                q = queues[tenant]
                if not q or len(self.slots) >= self.max_batch_size:
                    continue
                if capped and running.get(tenant, 0) >= share:
                    continue
                seq = q.popleft()
                seq.slot = len(self.slots)
                seq.admitted = time.perf_counter()
                self.slots.append(seq)
                admitted.add(seq.seq_id)
                running[tenant] = running.get(tenant, 0) + 1
                self._last_tenant = tenant
                progressed = True
            if not progressed:
                if not capped:
                    break
                # every tenant with waiting work is at its share: the spare slots go
                # round-robin anyway (a free slot is never left idle)
                capped = False
        if admitted:
            self.waiting = deque(s for s in self.waiting if s.seq_id not in admitted)

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def load(self) -> dict[str, int]:
        with self._cv:
            return {"running": len(self.slots), "waiting": len(self.waiting)}

    def fail_where(self, predicate: Callable[[Sequence], bool], message: str) -> None:
        """End every queued or running sequence matching ``predicate`` with an error (caller holds the model lock)."""
        with self._cv:
            victims = [s for s in [*self.slots, *self.waiting] if predicate(s)]
            self.waiting = deque(s for s in self.waiting if not predicate(s))
        for seq in victims:
            self._finish(seq, "error", error=message)
        with torch.inference_mode():
            self._release_finished()

    def has_work(self) -> bool:
        return bool(self.waiting or self.slots)

    def check(self) -> dict[str, object]:
        """The loop's state (load, steps, seconds since its last step); raises
        ``EngineUnavailable`` with the reason when the loop is dead, not running, or has left
        work waiting longer than ``stall_after`` without finishing a step. Cheap: it never
        waits for the model, so a loop stuck in a forward cannot stall the check too."""
        with self._cv:
            pending = [*self.slots, *self.waiting]
            now = self.clock.now()
            idle_for = now - max(self._beat, self._work_since)
            state: dict[str, object] = {
                "running": len(self.slots),
                "waiting": len(self.waiting),
                "steps": self.steps,
                "last_step_s": round(now - self._beat, 3) if self._beat > float("-inf") else None,
            }
        if self.dead is not None:
            raise EngineUnavailable(f"the engine loop died: {self.dead}")
        if not self.running:
            raise EngineUnavailable("the engine loop is not running")
        if pending and idle_for > self.stall_after:
            requests = len({s.request_id for s in pending})
            raise EngineUnavailable(
                f"the engine loop has not completed a step for {idle_for:.0f} s while {requests} "
                f"{'request waits' if requests == 1 else 'requests wait'} (limit {self.stall_after:g} s)"
            )
        return state

    # --- the thread ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self.dead = None
        self._beat = self.clock.now()
        self._thread = threading.Thread(target=self._loop, name="tandem-scheduler", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def _loop(self) -> None:
        try:
            if self.num_threads:
                # torch's CPU thread count must be set on the thread that runs the forwards
                torch.set_num_threads(self.num_threads)
            while True:
                with self._cv:
                    while not self._stop and not (self.waiting or self.slots or self._aborts):
                        self._cv.wait()
                    if not self.slots and self.admit_window > 0:
                        self._gather_burst()
                    if self._stop:
                        break
                self.step()
                self._beat = self.clock.now()
            self._fail_all("the engine is shutting down")
        except BaseException as exc:  # the thread ends here: say why, to every waiting stream
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """The loop ends with ``exc`` (one a step does not survive, or a failure while
        recovering from one): every sequence ends with an error now, new ones are refused, and
        ``check`` reports it. The runner is not touched: the device may be what failed."""
        log.critical("the engine loop died", exc_info=exc)
        with self._cv:
            self.dead = f"{type(exc).__name__}: {exc}"
            victims = [*self.slots, *self.waiting]
            self.slots.clear()
            self.waiting.clear()
        for seq in victims:
            try:
                self._finish(seq, "error", error=f"the engine loop died: {self.dead}")
            except Exception:  # one sink's failure must not keep the others waiting
                log.exception("could not end sequence %s", seq.request_id)

    def _gather_burst(self) -> None:
        """An idle engine lets a burst of arrivals gather before its first step, so they are
        scheduled together instead of the first one's prefill delaying all the others: it
        waits until no request has arrived for ``admit_window`` (HTTP requests of one burst
        trickle in over tens of ms), at most ``ADMIT_MAX_WINDOWS`` windows in all, and not
        once the batch is full. Caller holds ``_cv``."""
        now = self.clock.now()
        deadline = now + self.admit_window * ADMIT_MAX_WINDOWS
        quiet_at = now + self.admit_window
        seen = len(self.waiting)
        while not self._stop and len(self.waiting) < self.max_batch_size:
            left = min(quiet_at, deadline) - self.clock.now()
            if left <= 0:
                break
            self.clock.wait(self._cv, left)
            if len(self.waiting) > seen:
                seen = len(self.waiting)
                quiet_at = self.clock.now() + self.admit_window

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    # --- one iteration -----------------------------------------------------------------------
    def step(self) -> None:
        try:
            # inference mode for the whole step: the KV slab is created and grown inside it,
            # and in-place updates of it (hole filling) must happen inside it too
            with self.model_lock, torch.inference_mode():
                self._step()
            self.last_error = None
        except Exception as exc:  # a failed forward must not take the service down
            log.exception("scheduler step failed")
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._fail_all(f"generation failed: {self.last_error}")

    def _fail_all(self, message: str) -> None:
        with self._cv:
            victims = list(self.slots) + list(self.waiting)
            self.slots.clear()
            self.waiting.clear()
        for seq in victims:
            self._finish(seq, "error", error=message)
        with self.model_lock:
            self.runner.reset()

    def _step(self) -> None:
        self.steps += 1
        with self._cv:
            aborts, self._aborts = self._aborts, set()
            now = time.monotonic()
            kept: deque[Sequence] = deque()
            dropped: list[tuple[Sequence, FinishReason]] = []
            for seq in self.waiting:
                if seq.request_id in aborts:
                    dropped.append((seq, "abort"))
                elif seq.deadline is not None and now > seq.deadline:
                    dropped.append((seq, "timeout"))
                else:
                    kept.append(seq)
            self.waiting = kept
            for seq in list(self.slots):
                if seq.request_id in aborts:
                    dropped.append((seq, "abort"))
                elif seq.deadline is not None and now > seq.deadline:
                    dropped.append((seq, "timeout"))
            self._admit()
        for seq, reason in dropped:
            error = "the request timed out" if reason == "timeout" else None
            self._finish(seq, reason, error=error)
        self._release_finished()
        if not self.slots:
            return
        t0 = time.perf_counter()
        decoded, prefilled = self._forward()
        self._release_finished()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step %d: %d decode tokens + %d prompt tokens in %.0f ms; %d running, %d waiting",
                self.steps,
                decoded,
                prefilled,
                (time.perf_counter() - t0) * 1e3,
                len(self.slots),
                len(self.waiting),
            )

    def _prompt_chunks(self) -> list[tuple[Sequence, int]]:
        """The prompt chunks of this step: oldest prompts first, up to ``prefill_chunk`` tokens."""
        pending = sorted((s for s in self.slots if not s.prefilled), key=lambda s: s.seq_id)
        kv = self._prefix_kv()
        if pending and kv is not None:
            self._reuse_prefixes(pending, kv)
            pending = [s for s in pending if not s.prefilled]
        budget = self.prefill_chunk
        chosen: list[tuple[Sequence, int]] = []
        for seq in pending:
            if budget <= 0:
                break
            chunk = min(len(seq.prompt_ids) - seq.num_computed, budget)
            chosen.append((seq, chunk))
            budget -= chunk
        return chosen

    def _forward(self) -> tuple[int, int]:
        """One forward: a token for every running sequence, plus this step's prompt chunks.

        Returns (decode tokens, prompt tokens)."""
        decoding = [s for s in self.slots if s.prefilled and s.output_ids and s.finish_reason is None]
        chunks = self._prompt_chunks()
        if not decoding and not chunks:
            return 0, 0
        drafts = self._drafts(decoding)
        # each sequence's last token, then its draft tokens at the positions after it (their logits
        # verify the draft); ``starts``: each sequence's first row
        decode_rows: list[DecodeRow] = []
        starts: list[int] = []
        for s, draft in zip(decoding, drafts, strict=True):
            starts.append(len(decode_rows))
            decode_rows.append(DecodeRow(s.slot, s.output_ids[-1], s.total_len - 1, s.adapter))
            decode_rows += [DecodeRow(s.slot, t, s.total_len + j, s.adapter) for j, t in enumerate(draft)]
        prefill_rows = [
            PrefillRow(s.slot, s.prompt_ids[s.num_computed : s.num_computed + c], s.num_computed, s.adapter)
            for s, c in chunks
        ]
        logits = self.runner.forward(decode_rows, prefill_rows)
        for seq in decoding:
            seq.num_computed = seq.total_len
        sampled = list(decoding)
        rows = list(starts)
        for i, (seq, chunk) in enumerate(chunks):
            seq.num_computed += chunk
            if seq.prefilled:
                sampled.append(seq)
                rows.append(len(decode_rows) + i)
        if sampled:
            tokens = self._sample_and_emit(sampled, logits if len(rows) == len(logits) else logits[rows])
            if any(drafts):
                self._verify(decoding, drafts, starts, tokens, logits)
        kv = self._prefix_kv()
        if kv is not None:
            # after the tokens went out: copying prompts into the cache is off the latency path.
            # A prompt once whole: storing each chunk's prefix copied a 1,500-token prompt's keys
            # and values 3.5 times over while its next chunk waited (0.25 s of a 4 s prefill)
            for seq, _ in chunks:
                if seq.prefilled:
                    self.prefix_cache.store(_adapter(seq), seq.prompt_ids[: seq.num_computed], kv, seq.slot)
        return len(decoding), sum(c for _, c in chunks)

    def _drafts(self, decoding: list[Sequence]) -> list[list[int]]:
        """Each decoding sequence's draft tokens this step ([] for none): looked up in its own
        prompt and output, never past its ``max_tokens`` or the context."""
        lookup = self.prompt_lookup
        if lookup is None:
            return [[] for _ in decoding]
        drafts: list[list[int]] = []
        budget = lookup.budget(len(decoding))
        for seq in decoding:
            # the step emits up to len(draft) + 1 tokens, each at a position inside the context
            room = min(seq.max_tokens - len(seq.output_ids), self.runner.max_len - seq.total_len) - 1
            if room <= 0 or budget <= 0:
                drafts.append([])
                continue
            if seq.ngrams is None:
                seq.ngrams = NgramIndex(seq.prompt_ids, lookup)
            drafts.append(seq.ngrams.propose(seq.output_ids, min(room, budget)))
            budget -= len(drafts[-1])
        return drafts

    def _verify(
        self,
        decoding: list[Sequence],
        drafts: list[list[int]],
        starts: list[int],
        tokens: list[int],
        logits: torch.Tensor,
    ) -> None:
        """Accept draft tokens while the sampled token equals the draft's next one (see
        prompt_lookup.py): each accepted token's logits row gives the sequence's next token,
        sampled in order, depth by depth, with the sequence's own generator and state."""
        stats = self.lookup_stats
        last = {i: tokens[i] for i, draft in enumerate(drafts) if draft}
        stats.drafts += len(last)
        stats.draft_tokens += sum(len(d) for d in drafts)
        live = list(last)
        depth = 0
        while live:
            held = [i for i in live if last[i] == drafts[i][depth]]
            stats.accepted_tokens += len(held)
            # an accepted draft token's key and value (written by this forward) are the sequence's own
            go = [i for i in held if decoding[i].finish_reason is None]
            for i in go:
                decoding[i].num_computed += 1
            if not go:
                return
            rows = [starts[i] + depth + 1 for i in go]
            for i, token in zip(
                go, self._sample_and_emit([decoding[i] for i in go], logits[rows]), strict=True
            ):
                last[i] = token
            depth += 1
            live = [i for i in go if depth < len(drafts[i])]

    def _prefix_kv(self) -> SlabKVCache | None:
        """The runner's slab when this scheduler keeps a prefix cache (None: it keeps none)."""
        return self.runner.prefix_kv if self.prefix_cache.enabled else None

    def _try_prefix_hit(self, seq: Sequence, kv: SlabKVCache) -> bool:
        entry, length = self.prefix_cache.longest(_adapter(seq), seq.prompt_ids)
        if entry is None:
            return False
        self.prefix_cache.load_into(entry, length, kv, seq.slot)
        seq.num_computed = length
        return True

    def _reuse_prefixes(self, pending: list[Sequence], kv: SlabKVCache) -> None:
        """Start newly admitted sequences from cached prefixes; compute a prefix shared by
        several new arrivals once (for the oldest of them) and copy it to the others."""
        cache = self.prefix_cache
        cache.validate(self.runner.weights_fingerprint())
        fresh = [s for s in pending if s.num_computed == 0 and not s.prefix_checked]
        if not fresh:
            return
        cache.query_tokens += sum(len(s.prompt_ids) for s in fresh)  # once per prompt (metrics)
        misses = [s for s in fresh if not self._try_prefix_hit(s, kv)]
        while len(misses) >= 2:
            leader, rest = misses[0], misses[1:]
            adapter = _adapter(leader)
            shared = max(
                (common_prefix_len(leader.prompt_ids, o.prompt_ids) for o in rest if _adapter(o) == adapter),
                default=0,
            )
            shared = min(shared, len(leader.prompt_ids) - 1, self.prefill_chunk, cache.max_entry_tokens)
            if shared >= cache.min_tokens:
                self.runner.forward(
                    [], [PrefillRow(leader.slot, leader.prompt_ids[:shared], 0, leader.adapter)]
                )
                leader.num_computed = shared
                cache.store(adapter, leader.prompt_ids[:shared], kv, leader.slot)
                rest = [o for o in rest if not self._try_prefix_hit(o, kv)]
            misses = rest
        for seq in fresh:
            seq.prefix_checked = True

    def _sample_and_emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Sample each sequence's next token from its logits row and hand it to its sink; returns
        the tokens."""
        rows = [
            RowSampling(
                s.params,
                s.generator,
                s.prompt_ids if s.params.penalized else None,
                s.output_ids if s.params.penalized else None,
                s.matcher,
            )
            for s in seqs
        ]
        tokens, raw_logprobs = sample(logits, rows)
        chosen_lp = raw_logprobs.gather(1, tokens.to(raw_logprobs.device).unsqueeze(1)).squeeze(1).tolist()
        token_list: list[int] = [int(t) for t in tokens.tolist()]
        for i, seq in enumerate(seqs):
            token = int(token_list[i])
            seq.output_ids.append(token)
            seq.logprobs.append(float(chosen_lp[i]))
            reason: FinishReason | None = None
            if seq.detok is not None:
                seq.detok.add(token)
            grammar_done = False
            if seq.matcher is not None:
                # the mask allowed only this grammar's tokens, so this accepts; a grammar that
                # reached its end (it then allows only end-of-text) ends the request
                accepted = seq.matcher.accept_token(token)
                grammar_done = not accepted or seq.matcher.is_terminated()
            if (
                grammar_done
                or (not seq.params.ignore_eos and token in self.eos_token_ids)
                or token in seq.params.stop_token_ids
                or (seq.detok is not None and seq.detok.stopped)
            ):
                reason = "stop"
            elif len(seq.output_ids) >= seq.max_tokens or seq.total_len >= self.runner.max_len:
                reason = "length"
            entry = None
            if seq.params.logprobs is not None:
                entry = self._logprob_entry(token, raw_logprobs[i], seq.params.logprobs)
            text = seq.detok.flush(reason is not None) if seq.detok is not None else ""
            if reason is not None:
                seq.finish_reason = reason
            seq.sink(
                StreamEvent(
                    index=seq.index,
                    token_ids=[token],
                    text=text,
                    logprobs=[entry] if entry is not None else None,
                    finish_reason=reason,
                    prompt_tokens=len(seq.prompt_ids),
                    completion_tokens=len(seq.output_ids),
                    queued_s=seq.admitted - seq.submitted
                    if seq.admitted is not None and len(seq.output_ids) == 1
                    else None,
                )
            )
        return token_list

    def _token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def _logprob_entry(self, token: int, row: torch.Tensor, k: int) -> TokenLogprob:
        top: list[TopLogprob] = []
        if k > 0:
            values, ids = torch.topk(row, k)
            top = [
                TopLogprob(int(t), self._token_text(int(t)), float(v))
                for v, t in zip(values.tolist(), ids.tolist(), strict=True)
            ]
        return TokenLogprob(token, self._token_text(token), float(row[token]), top)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.finish_reason is not None and reason != "error":
            return
        seq.finish_reason = reason
        seq.sink(
            StreamEvent(
                index=seq.index,
                token_ids=[],
                text=seq.detok.flush(True) if seq.detok is not None and reason in ("stop", "length") else "",
                logprobs=None,
                finish_reason=reason,
                prompt_tokens=len(seq.prompt_ids),
                completion_tokens=len(seq.output_ids),
                error=error,
            )
        )

    def _release_finished(self) -> None:
        """Free the slots of finished sequences, keeping slots 0..N-1 contiguous."""
        with self._cv:
            done = [s.slot for s in self.slots if s.finish_reason is not None]
        # the runner frees what each held before another sequence moves into its slot
        for slot in done:
            self.runner.release(slot)
        with self._cv:
            i = 0
            while i < len(self.slots):
                seq = self.slots[i]
                if seq.finish_reason is None:
                    i += 1
                    continue
                last = self.slots[-1]
                if last is not seq:
                    # fill the hole with the last row (only its computed positions move);
                    # moved before anything is popped, so a failure loses no sequence
                    self.runner.move_slot(last.slot, i, last.num_computed)
                    last.slot = i
                    self.slots[i] = last
                self.slots.pop()
                # re-check index i: it now holds the moved sequence
