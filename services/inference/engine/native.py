"""The engine's C++ kernels for CPU decode and prompt chunks (``csrc/decode_layers.cpp``), built on
the machine where the CPU has AVX2.

At one row, a SmolLM2 decode step through Python is ~1,800 small ATen calls, each paying its
argument parsing, torch-function checks and tensor wrappers on top of the kernel. The module
holds five things:

- ``decode_own``: the lean forward's loop over the decoder layers with the operations between
  the int4 products computed by the loop itself (add + RMSNorm, RoPE and the KV write, each
  row's attention over its own keys, SiLU * up): 4 ATen calls a layer instead of ~60. Its own
  sums, so not the Python loop's last bits (that loop is the bit-exact reference), but each
  row's numbers depend on that row alone (the same alone as in any batch). The products are the
  int4 ones of an fp32 model or oneDNN's of the model's own fp32 or bf16 weights (bf16: the KV
  slabs bf16 too, as they are; the residual stream fp32 either way). The default (the plan's
  ``decode="native-own"``).
- ``q8_rows``: the output head's decode rows against GGUF's Q8_0 (int8 in blocks of 32, the
  default model file's own head format, exactly), each row's inputs as int8 in blocks of 32
  (llama.cpp's Q8_0 x Q8_0), exact integer sums by AVX512-VNNI: about half the bytes of the bf16
  head, and faster than oneDNN's bf16 head at 1 to 16 rows on a Xeon with AMX. ``q8_linear``: the same weights times fp32 rows
  (fp32 FMAs), for CPUs with AVX2 alone.
- ``q4_linear``: the decoder layers' int4 decode products: the weights in Q4_1 groups (the
  default model file's own format, exactly; scales and minima as fp32 bases times int8
  multipliers, 4.75 bits a weight, Q4_K's values exactly, or fp16 ones, 5.25 bits, Q4_0's and
  Q4_1's exactly), each row's inputs as int8 in groups of 32 (llama.cpp's Q4_1
  x Q8_1), exact integer sums; AVX512-VNNI where the CPU has it, else AVX2, the same numbers bit
  for bit. Without the module the layers keep
  ``aten._weight_int4pack_mm_for_cpu`` with bf16 rows.
- ``prompt_own``: the lean prompt forward's layers (``fused_prompt.py``), the products oneDNN's
  bf16 ones in blocks, the attention ragged's prompt attention as ATen calls, ``decode_own``'s
  operations between them.

There is no wheel to install: torch's ``cpp_extension`` compiles the one source file with the
machine's C++ compiler (``c++``, and ``ninja`` from PyPI) into torch's extension directory
(``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``; one build per torch version and
instruction set), ~30 s once, then loads it in about a second on later starts.
``TANDEM_INFERENCE_NATIVE_DECODE``:

- ``auto`` (the default): built (or loaded) when the engine is made, before it serves; a failed
  build (no compiler) is logged once with its reason and the engine keeps the Python loop and
  the bf16 head for its whole life (a stream's numbers never change kernels half-way).
- ``on``: the same, but a failed build stops start-up with its reason.
- ``off``: never built.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("tandem.engine.native")

NativeDecode = Literal["auto", "on", "off"]
SOURCE = Path(__file__).parent / "csrc" / "decode_layers.cpp"


class NativeBuildError(RuntimeError):
    """The C++ module could not be built or loaded (the message says why)."""


class _Build:
    """One build of the extension, shared by every engine of the process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: Any = None
        self.problem: str | None = None


_BUILD = _Build()


def avx2() -> bool:
    """Whether torch runs AVX2 (or AVX-512) kernels here: the kernels' vectors are AVX2's."""
    from services.common.platforms import cpu_features

    return cpu_features().avx2


def _module_name() -> str:
    import torch

    # one build per torch version: an extension built against another torch must not load
    return "tandem_decode_layers_avx2_" + re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)


# a build holds torch's lock file for ~30-65 s on 2 cores; one older than this was left by a
# process killed while building (torch's lock names no process), and every later start would wait
# on it forever
STALE_BUILD_S = 600.0


def clear_stale_lock(now: float | None = None) -> bool:
    """Remove the build folder's lock when it is older than ``STALE_BUILD_S`` (``now``: the clock,
    seconds since the epoch; None: the time now); True when one was removed."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(_module_name(), verbose=False)) / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_BUILD_S:
        return False
    log.warning("removing a stale build lock (%.0f s old, a build killed half-way): %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def _compile() -> Any:
    if not avx2():
        raise NativeBuildError("the CPU has no AVX2 (the kernels' vectors are AVX2's)")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise NativeBuildError("no C++ compiler (c++ or g++) on PATH")
    if shutil.which("ninja") is None:
        # the ninja wheel's binary, where the venv's bin folder is not on PATH (a service
        # started as .venv/bin/python -m uvicorn)
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load

    start = time.monotonic()
    clear_stale_lock()
    # the vectors are ATen's AVX2 ones (its headers pick them by CPU_CAPABILITY; q4_linear's
    # AVX512-VNNI kernels are compiled for their own target and called only where the CPU has it).
    # -fopenmp: at::parallel_for is inlined from ATen's header as an OpenMP loop, serial without
    # it; the module then needs libgomp.so.1, which resolves to the copy torch has loaded (one
    # runtime, torch's threads)
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    module = load(
        _module_name(), [str(SOURCE)], extra_cflags=["-O2", *flags], extra_ldflags=["-fopenmp"], verbose=False
    )
    log.info("native decode kernels ready in %.1f s", time.monotonic() - start)
    return module


def start(mode: NativeDecode) -> bool:
    """Build (or load) the module now unless ``mode`` is off; True when it is loaded. A failed
    build raises ``NativeBuildError`` under ``on`` and is logged once under ``auto``."""
    if mode == "off":
        return False
    with _BUILD.lock:
        if _BUILD.module is None and (_BUILD.problem is None or mode == "on"):
            try:
                _BUILD.module = _compile()
                _BUILD.problem = None
            except Exception as exc:  # a missing compiler or a failed build must not stop auto
                _BUILD.problem = f"{type(exc).__name__}: {exc}"
                if mode == "on":
                    raise NativeBuildError(
                        f"TANDEM_INFERENCE_NATIVE_DECODE=on: the C++ decode kernels could not be built: {exc}"
                    ) from exc
                log.warning(
                    "the native decode kernels were not built (%s); decode keeps the Python loop",
                    _BUILD.problem,
                )
        return _BUILD.module is not None


def decode_own() -> Any:
    """The C++ loop with its own operations between the products, or None (not built)."""
    return getattr(_BUILD.module, "decode_own", None)


def prompt_own() -> Any:
    """The prompt chunks' layers with bf16 block products and the own operations between them
    (``fused_prompt.py``), or None (not built)."""
    return getattr(_BUILD.module, "prompt_own", None)


def q8_rows() -> Any:
    """The Q8_0 x int8 rows product (it refuses a CPU without AVX512-VNNI), or None (not built)."""
    return getattr(_BUILD.module, "q8_rows", None)


def q8_linear() -> Any:
    """The Q8_0 block product, or None (not built)."""
    return getattr(_BUILD.module, "q8_linear", None)


def q4_linear() -> Any:
    """The int4 (Q4_1 groups) product with int8 rows, or None (not built)."""
    return getattr(_BUILD.module, "q4_linear", None)


def problem() -> str | None:
    """Why the module is not loaded (None once loaded, or before any build was tried)."""
    return _BUILD.problem
