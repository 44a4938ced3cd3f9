"""The lean forward's loop over the decoder layers in C++ (``csrc/decode_layers.cpp``).

At one row, a SmolLM2 decode step is ~1,800 small ATen calls; from Python each costs its
argument parsing, torch-function checks and tensor wrappers on top of the kernel. The C++ loop
calls the same ATen operations on the same values in the same order, so its numbers are the
Python loop's bit for bit (``test_fused_decode.py``), only without that plumbing (one step
9.4 -> 8.3 ms on 2 EPYC cores; benchmarks/RESULTS.md).

There is no wheel to install: torch's ``cpp_extension`` compiles the one source file with the
machine's C++ compiler (``c++``, and ``ninja`` from PyPI) into torch's extension directory
(``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``; one build per torch version),
~25 s once, then loads it in about a second on later starts. ``TANDEM_INFERENCE_NATIVE_DECODE``:

- ``auto`` (the default): built in a background thread at start-up; decode steps take the Python
  loop until it is loaded, then the C++ one (the same numbers, so a stream never notices). A
  failed build (no compiler) is logged once with its reason and the Python loop stays.
- ``on``: built before the engine serves; a failed build stops start-up with its reason.
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
    """The C++ loop could not be built or loaded (the message says why)."""


class _Build:
    """One build of the extension, shared by every engine of the process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.function: Any = None
        self.problem: str | None = None

    def run(self) -> None:
        try:
            function = _compile()
        except Exception as exc:  # a missing compiler or a failed build must not stop serving
            self.problem = f"{type(exc).__name__}: {exc}"
            log.warning(
                "the native decode loop was not built (%s); decode steps keep the Python loop", self.problem
            )
            return
        self.function = function


_BUILD = _Build()


def _module_name() -> str:
    import torch

    # one build per torch version: an extension built against another torch must not load
    return "tandem_decode_layers_" + re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)


def _compile() -> Any:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise NativeBuildError("no C++ compiler (c++ or g++) on PATH")
    if shutil.which("ninja") is None:
        # the ninja wheel's binary, where the venv's bin folder is not on PATH (a service
        # started as .venv/bin/python -m uvicorn)
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load

    start = time.monotonic()
    module = load(_module_name(), [str(SOURCE)], extra_cflags=["-O2"], verbose=False)
    log.info("native decode loop ready in %.1f s", time.monotonic() - start)
    return module.decode_layers


def start(mode: NativeDecode) -> None:
    """Build (``on``: now, raising ``NativeBuildError``) or start building (``auto``) the loop."""
    if mode == "off":
        return
    with _BUILD.lock:
        if mode == "on":
            if _BUILD.function is None:
                try:
                    _BUILD.function = _compile()
                except Exception as exc:
                    raise NativeBuildError(
                        f"TANDEM_INFERENCE_NATIVE_DECODE=on: the C++ decode loop could not be built: {exc}"
                    ) from exc
            return
        if _BUILD.thread is None and _BUILD.function is None:
            _BUILD.thread = threading.Thread(target=_BUILD.run, name="tandem-native-build", daemon=True)
            _BUILD.thread.start()


def wait(timeout: float | None = None) -> bool:
    """Wait for a background build (tests, benchmarks); True when the loop is loaded."""
    thread = _BUILD.thread
    if thread is not None:
        thread.join(timeout)
    return _BUILD.function is not None


def decode_layers() -> Any:
    """The C++ loop, or None while it is not (yet) built."""
    return _BUILD.function


def problem() -> str | None:
    """Why the loop is not loaded (None while building, or once loaded)."""
    return _BUILD.problem
