"""An engine on llama.cpp (through ``llama-cpp-python``'s low-level API) for GGUF models.

It keeps everything the torch engine adds around the forward: both are a ``SchedulerEngine``
(``scheduler_engine.py``), the same ``Scheduler`` driving a llama.cpp runner here instead of
the torch ``ModelRunner`` (both implement ``runner_protocol.Runner``):

- continuous batching: each step is one ``llama_decode`` of one ``llama_batch`` with a
  token for every running sequence plus prompt chunks (up to ``PREFILL_CHUNK`` tokens),
  each token tagged with its sequence's id in llama.cpp's multi-sequence KV cache (one
  KV stream per sequence, ``kv_unified = false``, so a decode token attends only to its
  own sequence's cells); a finished sequence's cells are freed with ``llama_memory_seq_rm``;
- the scheduler's per-tenant fair share, queue limits, timeouts, aborts, stop strings,
  streaming detokenisation, sampling (temperature/top-p/top-k/seeds/penalties, on the
  logits llama.cpp returns) and xgrammar-constrained decoding (``response_format``,
  ``tools``), all unchanged: the scheduler only sees logits;
- prompts through the model's Hugging Face tokenizer and chat template (read from the
  GGUF file), exactly as the torch engine renders them.

LoRA adapters: llama.cpp applies the adapters set on a context to every token of a
``llama_decode``, so one decode cannot mix adapters. Each step therefore runs one
``llama_decode`` per adapter present in the batch (the base model counts as one), each
over that adapter's rows, with ``llama_set_adapters_lora`` switching the context's
adapter in between; rows of one adapter still batch together. The cost is one more read
of the weights per extra adapter in a step (measured in ``docs/inference.md``). PEFT
adapter folders are converted to GGUF when loaded (``gguf_lora.py``); a ``.gguf`` adapter
loads as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.inference.engine import defaults
from services.inference.engine.loader import _file_lock, gguf_cache_dir
from services.inference.engine.ragged import DecodeRow, PrefillRow
from services.inference.engine.scheduler_engine import SchedulerEngine
from services.inference.engine.types import AdapterError

log = logging.getLogger("tandem.engine.llamacpp")

INSTALL_HINT = (
    "pip install llama-cpp-python==0.3.36 (no wheel for this platform on PyPI: it compiles "
    "llama.cpp, ~20 minutes on 2 cores; or pip install the wheel you built once)"
)


_log_callback: Any = None


class LlamaCppMissing(RuntimeError):
    """``llama_cpp`` cannot be imported."""


def import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppMissing(
            f"TANDEM_INFERENCE_ENGINE=llamacpp needs the llama_cpp module ({exc}): {INSTALL_HINT}"
        ) from None
    global _log_callback
    if _log_callback is None:
        # llama.cpp prints every log line to stderr (model loading: hundreds); its warnings and
        # errors go to our log instead, the rest nowhere
        @llama_cpp.llama_log_callback
        def forward_log(level: int, text: bytes, _: ctypes.c_void_p) -> None:
            if level in (3, 4):  # ggml.h: GGML_LOG_LEVEL_WARN = 3, GGML_LOG_LEVEL_ERROR = 4
                log.log(
                    logging.WARNING if level == 3 else logging.ERROR,
                    "%s",
                    text.decode(errors="replace").rstrip(),
                )

        _log_callback = forward_log  # kept referenced: llama.cpp holds only the C pointer
        llama_cpp.llama_log_set(forward_log, ctypes.c_void_p(0))
    return llama_cpp


def check_gguf(path: Path) -> None:
    """Raises ``ValueError`` naming ``path`` unless it is a GGUF file."""
    if not path.is_file():
        raise ValueError(f"the llamacpp engine needs a .gguf model file; {path} is not a file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"the llamacpp engine needs a GGUF model file; {path} is not one (no GGUF header)")


def open_llama(
    gguf: Path, *, max_seqs: int, max_len: int, threads: int, batch_tokens: int
) -> tuple[Any, Any, Any, int]:
    """llama.cpp's module, model, a context for ``max_seqs`` sequences of up to ``max_len``
    tokens (capped by the model's training context) each, and that length.

    One KV stream of ``max_len`` cells per sequence (``kv_unified`` false): a token attends
    to its own sequence's cells only, not to one buffer shared and masked per sequence,
    which llama.cpp documents as faster when sequences share no long prefix."""
    ll = import_llama_cpp()
    ll.llama_backend_init()
    mparams = ll.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(str(gguf).encode(), mparams)
    if not model:
        raise ValueError(f"llama.cpp could not load the model file {gguf}")
    max_len = min(max_len, int(ll.llama_model_n_ctx_train(model)) or max_len)
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = max_len * max_seqs
    cparams.n_batch = batch_tokens
    cparams.n_ubatch = batch_tokens
    cparams.n_seq_max = max_seqs
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.kv_unified = False
    cparams.no_perf = True
    ctx = ll.llama_init_from_model(model, cparams)
    if not ctx:
        ll.llama_model_free(model)
        raise ValueError(f"llama.cpp could not create a context for {gguf} ({max_seqs} x {max_len} tokens)")
    return ll, model, ctx, max_len


# llama.cpp's file types the engine may re-quantise a model to (llama_ftype)
REQUANTIZE_TYPES = {"q8_0": 7, "q4_0": 2}


def requantized(gguf: Path, kind: str, cache_root: Path) -> Path:
    """``gguf`` re-quantised to ``kind`` once, cached next to the torch engine's conversions.

    Why: llama.cpp's CPU backend repacks Q8_0 and Q4_0 weights into layouts its batched GEMM
    kernels use (``CPU_REPACK``), but not Q4_1, whose matrix products run as row-by-row dot
    products: on this 2-core machine the default Q4_1 file decodes 16 streams barely faster
    than one. Q8_0 holds Q4_1's 16 levels per block on a grid 8x finer: logits correlate
    0.998-0.999 with the file's (three prompts; near ties may flip, as between any two
    kernels). Q4_0 is faster still but lossy from Q4_1 (0.93-0.96). Not the default: with
    repacked weights a row's numerics depend on how many rows share its product (GEMM vs GEMV
    kernels), and greedy outputs alone and in a batch were seen to differ on near ties."""
    if kind not in REQUANTIZE_TYPES:
        raise ValueError(f"unknown re-quantisation {kind!r}; one of {', '.join(REQUANTIZE_TYPES)}")
    target = cache_root / f"{gguf_cache_dir(gguf, cache_root).name}-{kind}.gguf"
    if target.is_file():
        return target
    ll = import_llama_cpp()
    with _file_lock(cache_root / ".locks" / f"{target.name}.lock"):
        if target.is_file():
            return target
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        params = ll.llama_model_quantize_default_params()
        params.ftype = REQUANTIZE_TYPES[kind]
        params.allow_requantize = True
        rc = ll.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            tmp.unlink(missing_ok=True)
            raise ValueError(f"llama.cpp could not re-quantise {gguf} to {kind} (code {rc})")
        os.replace(tmp, target)
    return target


class LlamaCppRunner:
    """The forward the scheduler drives, on a llama.cpp context (a ``Runner``)."""

    # llama.cpp returns its logits in host memory
    device = torch.device("cpu")
    # no prefix cache: llama.cpp's cells are no slab rows to copy prefixes between
    prefix_kv = None

    def __init__(self, gguf: Path, *, max_slots: int, max_len: int, threads: int, batch_tokens: int) -> None:
        check_gguf(gguf)
        self.ll, self.lm, self.ctx, self.max_len = open_llama(
            gguf, max_seqs=max_slots, max_len=max_len, threads=threads, batch_tokens=batch_tokens
        )
        ll = self.ll
        self.max_slots = max_slots
        self.batch_tokens = batch_tokens
        self.mem = ll.llama_get_memory(self.ctx)
        self.vocab = ll.llama_model_get_vocab(self.lm)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
        self.batch = ll.llama_batch_init(batch_tokens, 0, 1)
        self.seq_of_slot: dict[int, int] = {}
        self._free_ids = list(range(max_slots - 1, -1, -1))
        # name -> llama_adapter_lora pointer; the adapter set on the context now (None: none)
        self.adapters: dict[str, Any] = {}
        self._active: str | None = None

    def prepare_weights(self) -> None:
        """llama.cpp reads its weights from the file as they are."""

    def weights_fingerprint(self) -> tuple[Any, ...]:
        # the file's weights never change while it is served
        return ()

    # --- the model's facts ---------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self.ll.llama_model_meta_val_str(self.lm, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def eog_ids(self) -> set[int]:
        # llama.cpp's own end-of-generation set (eos, eot, <|im_end|>-like tokens)
        return {t for t in range(self.n_vocab) if self.ll.llama_vocab_is_eog(self.vocab, t)}

    # --- sequences -------------------------------------------------------------------------
    def _fresh(self, slot: int) -> int:
        """The sequence id of a sequence starting at ``slot``: its own id with no cells."""
        seq = self.seq_of_slot.get(slot)
        if seq is None:
            seq = self._free_ids.pop()
            self.seq_of_slot[slot] = seq
        self.ll.llama_memory_seq_rm(self.mem, seq, -1, -1)
        return seq

    def move_slot(self, src: int, dst: int, length: int) -> None:
        # llama.cpp's cache is addressed by sequence id: a move is a change of which id a slot
        # names, no keys or values are copied
        moved = self.seq_of_slot.pop(src, None)
        if moved is None:
            self.seq_of_slot.pop(dst, None)
        else:
            self.seq_of_slot[dst] = moved

    def release(self, slot: int) -> None:
        """Free the KV cells of the sequence at ``slot`` (it finished)."""
        seq = self.seq_of_slot.pop(slot, None)
        if seq is not None:
            self.ll.llama_memory_seq_rm(self.mem, seq, -1, -1)
            self._free_ids.append(seq)

    def reset(self) -> None:
        for slot in list(self.seq_of_slot):
            self.release(slot)

    # --- LoRA ---------------------------------------------------------------------------------
    def _use_adapter(self, name: str | None) -> None:
        if name == self._active:
            return
        if name is None:
            rc = self.ll.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            arr = (self.ll.llama_adapter_lora_p_ctypes * 1)(self.adapters[name])
            scales = (ctypes.c_float * 1)(1.0)
            rc = self.ll.llama_set_adapters_lora(self.ctx, arr, 1, scales)
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not set the LoRA adapter {name!r} (code {rc})")
        self._active = name

    def add_adapter(self, name: str, path: Path) -> None:
        handle = self.ll.llama_adapter_lora_init(self.lm, str(path).encode())
        if not handle:
            raise AdapterError(
                f"lora_path {str(path)!r}: llama.cpp could not load this GGUF adapter onto the base "
                "model (another architecture or shape)"
            )
        self.adapters[name] = handle

    def drop_adapter(self, name: str) -> None:
        handle = self.adapters.pop(name)
        if self._active == name:
            self._use_adapter(None)
        self.ll.llama_adapter_lora_free(handle)

    # --- the forward ----------------------------------------------------------------------------
    def forward(self, decode: list[DecodeRow], prefill: list[PrefillRow]) -> torch.Tensor:
        """Logits ``[D + P, V]``: one row per decode token, then one at each chunk's last token."""
        out = np.empty((len(decode) + len(prefill), self.n_vocab), dtype=np.float32)
        groups: dict[str | None, list[tuple[int, DecodeRow | PrefillRow]]] = {}
        for i, d in enumerate(decode):
            groups.setdefault(d.adapter, []).append((i, d))
        for j, p in enumerate(prefill):
            groups.setdefault(p.adapter, []).append((len(decode) + j, p))
        # the adapter set on the context now goes first: one switch less per step
        order = sorted(groups, key=lambda a: a != self._active)
        for adapter in order:
            self._use_adapter(adapter)
            self._decode(groups[adapter], out)
        return torch.from_numpy(out)

    def _decode(self, rows: list[tuple[int, DecodeRow | PrefillRow]], out: np.ndarray) -> None:
        batch = self.batch
        n = 0
        targets: list[int] = []
        for row_index, row in rows:
            if isinstance(row, DecodeRow):
                tokens, start = [row.token], row.position
                seq = self.seq_of_slot[row.slot]
            else:
                tokens, start = row.token_ids, row.start
                seq = self._fresh(row.slot) if row.start == 0 else self.seq_of_slot[row.slot]
            last = len(tokens) - 1
            for k, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = start + k
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = k == last
                n += 1
            targets.append(row_index)
        if n > self.batch_tokens:  # the scheduler's budget keeps a step within the batch
            raise RuntimeError(f"a step of {n} tokens exceeds llama.cpp's batch of {self.batch_tokens}")
        batch.n_tokens = n
        rc = self.ll.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed (code {rc}) on a step of {n} tokens")
        # outputs come in batch order, one per token flagged for logits
        logits = np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(len(targets), self.n_vocab))
        out[targets] = logits

    def close(self) -> None:
        for name in list(self.adapters):
            self.drop_adapter(name)
        if self.ctx:
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ctx = None
        if self.lm:
            self.ll.llama_model_free(self.lm)
            self.lm = None


class LlamaCppEngine(SchedulerEngine[LlamaCppRunner]):
    """The ``Engine`` protocol over llama.cpp: the scheduler's request handling over a
    ``LlamaCppRunner``; its defaults are the server's (``defaults.py``)."""

    kind = "llamacpp"

    def __init__(
        self,
        gguf: str | Path,
        *,
        name: str = "model",
        tokenizer: Any = None,
        max_batch_size: int = defaults.MAX_BATCH_SIZE,
        max_queue: int = defaults.MAX_QUEUE,
        prefill_chunk: int = defaults.PREFILL_CHUNK,
        max_model_len: int | None = defaults.MAX_MODEL_LEN,
        request_timeout: float | None = defaults.REQUEST_TIMEOUT_S,
        threads: int = defaults.THREADS,
        admit_window: float = defaults.ADMIT_WINDOW_MS / 1000,
        tenant_max_queued: int | None = defaults.TENANT_MAX_QUEUED,
        stall_after: float = defaults.STALL_S,
        cache_root: Path | None = None,
        requantize: str = defaults.LLAMACPP_REQUANTIZE,
    ) -> None:
        """``max_model_len`` None: the model's training context. ``threads`` 0: all cores.
        ``tokenizer`` None: the Hugging Face tokenizer read from the GGUF file."""
        path = Path(gguf)
        check_gguf(path)
        self.gguf = path
        self.cache_root = cache_root or path.parent
        served = path if requantize == "none" else requantized(path, requantize, self.cache_root)
        runner = LlamaCppRunner(
            served,
            max_slots=max_batch_size,
            max_len=max_model_len or 1 << 30,
            threads=threads or os.cpu_count() or 1,
            batch_tokens=max(16, prefill_chunk) + max_batch_size,
        )
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        eos = runner.eog_ids()
        if isinstance(tokenizer.eos_token_id, int):
            eos.add(tokenizer.eos_token_id)
        super().__init__(
            runner,
            tokenizer,
            name=name,
            eos_token_ids=eos,
            vocab_size=runner.n_vocab,
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            prefill_chunk=prefill_chunk,
            request_timeout=request_timeout,
            # torch only samples here (a few ops on [rows, vocab]); its threads must not
            # compete with llama.cpp's
            num_threads=1,
            # no prefix cache (the runner has no slab to copy prefixes between)
            prefix_cache_mb=0,
            admit_window=admit_window,
            tenant_max_queued=tenant_max_queued,
            stall_after=stall_after,
        )

    async def shutdown(self) -> None:
        await super().shutdown()
        with self.model_lock:
            self.runner.close()

    # --- LoRA adapters ------------------------------------------------------------------------------
    def _gguf_adapter(self, folder: Path) -> Path:
        from services.inference.engine.gguf_lora import (
            BaseShape,
            LoraConversionError,
            convert_peft_lora,
            converted_path,
        )

        target = converted_path(folder, self.cache_root)
        with _file_lock(target.parent / ".locks" / f"{target.name}.lock"):
            if target.is_file():
                return target
            llama = self.runner
            base = BaseShape(
                arch=llama.meta("general.architecture") or "?",
                n_layers=int(llama.ll.llama_model_n_layer(llama.lm)),
                n_head=int(llama.ll.llama_model_n_head(llama.lm)),
                n_head_kv=int(llama.ll.llama_model_n_head_kv(llama.lm)),
            )
            try:
                return convert_peft_lora(folder, base, target)
            except LoraConversionError as exc:
                raise AdapterError(
                    f"lora_path {str(folder)!r} cannot be served by the llamacpp engine: {exc}"
                ) from None

    def load_adapter_sync(self, name: str, path: str) -> None:
        source = Path(path)
        if source.is_file() and source.suffix == ".gguf":
            gguf = source
        elif source.is_dir() and (source / "adapter_config.json").is_file():
            gguf = self._gguf_adapter(source)
        elif source.is_dir():
            raise AdapterError(f"lora_path {path!r} is not a PEFT adapter folder (no adapter_config.json)")
        else:
            raise AdapterError(f"lora_path {path!r} is neither a PEFT adapter folder nor a .gguf adapter")
        with self.model_lock:
            self.check_free(name)
            self.runner.add_adapter(name, gguf)
            self.adapters[name] = path

    def unload_adapter_sync(self, name: str) -> None:
        with self.model_lock:
            self.check_loaded(name)
            self.scheduler.fail_where(lambda s: s.adapter == name, f"adapter {name!r} was unloaded")
            self.runner.drop_adapter(name)
            del self.adapters[name]
