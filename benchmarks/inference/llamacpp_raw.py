"""llama.cpp itself as the contender: the same GGUF file through ``llama-cpp-python``'s
low-level API, in this process, with no server in between.

- one stream: each request's prompt in one ``llama_decode``, then one ``llama_decode`` per
  token (greedy, exactly ``max_tokens`` tokens);
- C streams: llama.cpp's own batched decoding of several sequences (as its ``batched``
  example and server do): one ``llama_batch`` per step holding one token of every running
  sequence (each tagged with its sequence id in a multi-sequence KV cache) plus the whole
  prompts of requests that just started, as many as the batch's 2,048 tokens hold (the others wait
  for the next step); each stream sends its requests one after another
  (closed loop, as the server load does), its next request joining the next step.

Times are taken as each token's logits come back, so TTFT (request start to first token)
and inter-token latencies compare with the server's SSE-side figures (which add HTTP).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class _Stream:
    prompts: list[list[int]]
    seq: int
    pending: list[int] = field(default_factory=list)
    pos: int = 0
    made: int = 0
    started: float = 0.0
    times: list[float] = field(default_factory=list)
    last_token: int = 0


class LlamaCppRaw:
    def __init__(self, gguf: Path, *, threads: int, max_seqs: int, n_ctx_per_seq: int = 1024) -> None:
        from services.inference.engine.llamacpp_engine import open_llama

        # the same context set-up as the llamacpp engine's: the comparison is of what runs on it
        self.ll, self.model, self.ctx, _ = open_llama(
            gguf, max_seqs=max_seqs, max_len=n_ctx_per_seq, threads=threads, batch_tokens=2048
        )
        ll = self.ll
        self.mem = ll.llama_get_memory(self.ctx)
        self.n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model)))
        self.capacity = 2048
        self.batch = ll.llama_batch_init(self.capacity, 0, 1)
        self.max_seqs = max_seqs

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode (token, position, seq, wants logits) entries; the logits rows in order."""
        b = self.batch
        for n, (token, pos, seq, out) in enumerate(entries):
            b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, out
            b.seq_id[n][0] = seq
        b.n_tokens = len(entries)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")
        n_out = sum(1 for e in entries if e[3])
        ptr = ctypes.cast(self.ll.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    def prefill(self, ids: list[int]) -> float:
        """Seconds for one prompt in one ``llama_decode`` (logits at its last token), alone in an
        emptied cache: llama.cpp's prefill as its server runs a lone request."""
        self.ll.llama_memory_clear(self.mem, True)
        t0 = time.perf_counter()
        self._decode([(t, k, 0, k == len(ids) - 1) for k, t in enumerate(ids)]).argmax()
        return time.perf_counter() - t0

    def run(self, prompts_per_stream: list[list[list[int]]], max_tokens: int) -> dict[str, Any]:
        """Each stream's prompts one after another, all streams batched together."""
        if len(prompts_per_stream) > self.max_seqs:
            raise ValueError(f"{len(prompts_per_stream)} streams > {self.max_seqs} sequences")
        self.ll.llama_memory_clear(self.mem, True)
        now: Callable[[], float] = time.perf_counter
        streams = [_Stream(list(p), seq=i) for i, p in enumerate(prompts_per_stream)]
        ttft: list[float] = []
        itl: list[float] = []
        tokens = requests = 0
        start = now()
        for s in streams:
            s.pending, s.started = s.prompts.pop(0), start
        active = list(streams)
        while active:
            entries: list[tuple[int, int, int, bool]] = []
            owners: list[_Stream] = []
            for s in active:
                if s.pending and len(entries) + len(s.pending) > self.capacity:
                    continue  # no room in this step's batch: the prompt waits for the next
                if s.pending:  # a new request: its whole prompt, logits at its last token
                    last = len(s.pending) - 1
                    entries += [(t, k, s.seq, k == last) for k, t in enumerate(s.pending)]
                    s.pos, s.pending = len(s.pending), []
                else:
                    entries.append((s.last_token, s.pos, s.seq, True))
                    s.pos += 1
                owners.append(s)
            logits = self._decode(entries)
            picked = logits.argmax(axis=1)
            t = now()
            for s, token in zip(owners, picked.tolist(), strict=True):
                s.last_token = int(token)
                s.times.append(t)
                s.made += 1
                if s.made < max_tokens:
                    continue
                # the request is done: its figures, its KV cells freed, the stream's next request
                ttft.append(s.times[0] - s.started)
                itl += [b - a for a, b in zip(s.times, s.times[1:], strict=False)]
                tokens += s.made
                requests += 1
                self.ll.llama_memory_seq_rm(self.mem, s.seq, -1, -1)
                s.made, s.times = 0, []
                if s.prompts:
                    s.pending, s.started = s.prompts.pop(0), t
                else:
                    active.remove(s)
        wall = now() - start
        return {"tokens": tokens, "wall": wall, "ttft": ttft, "itl": itl, "requests": requests}
