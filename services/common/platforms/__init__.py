"""The accelerator platform layer: the one place that knows the devices.

Detection order: ``cuda`` (NVIDIA or ROCm builds of torch), ``xpu`` (Intel),
``npu`` (Ascend, via ``torch_npu``), ``mps`` (Apple), then ``cpu``.
``TANDEM_DEVICE`` overrides detection; asking for a device that is not
there is an error, not a silent fallback. The setting is read only through the settings
objects (``CommonSettings.device``): callers that hold them pass it in. No code outside this package calls
``torch.cuda.*`` (or its xpu/npu/mps twins) directly.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

DEVICE_TYPES = ("cuda", "xpu", "npu", "mps", "cpu")
# Celery queue a worker on each device type serves.
QUEUE_OF = {"cuda": "gpu", "xpu": "gpu", "npu": "npu", "mps": "cpu", "cpu": "cpu"}


class PlatformError(RuntimeError):
    pass


@dataclass(frozen=True)
class Platform:
    device_type: str
    # "nvidia" or "rocm" for cuda, else the device type
    vendor: str

    @property
    def queue(self) -> str:
        return QUEUE_OF[self.device_type]

    @property
    def is_accelerator(self) -> bool:
        return self.device_type != "cpu"

    def device(self, index: int = 0) -> Any:
        import torch

        if self.device_type in ("cpu", "mps"):
            return torch.device(self.device_type)
        return torch.device(self.device_type, index)

    def _module(self) -> Any:
        import torch

        return getattr(torch, self.device_type, None)

    def device_count(self) -> int:
        if self.device_type == "cpu":
            return 1
        mod = self._module()
        return int(mod.device_count()) if mod is not None and hasattr(mod, "device_count") else 1

    def synchronize(self) -> None:
        mod = self._module()
        if self.device_type != "cpu" and mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()

    def empty_cache(self) -> None:
        mod = self._module()
        if self.device_type != "cpu" and mod is not None and hasattr(mod, "empty_cache"):
            mod.empty_cache()

    def reset_peak_memory(self) -> None:
        mod = self._module()
        if self.device_type != "cpu" and mod is not None and hasattr(mod, "reset_peak_memory_stats"):
            mod.reset_peak_memory_stats()

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated on the device, or None where torch does not track it (cpu)."""
        mod = self._module()
        if self.device_type != "cpu" and mod is not None and hasattr(mod, "max_memory_allocated"):
            return int(mod.max_memory_allocated())
        return None

    def default_dtype(self) -> Any:
        """bf16 where the hardware does it well, fp32 on the CPU (bf16 matmuls are slow there)."""
        import torch

        if self.device_type == "cpu":
            return torch.float32
        if self.device_type == "mps":
            return torch.float16
        return torch.bfloat16


def _available(device_type: str) -> bool:
    import torch

    if device_type == "cpu":
        return True
    if device_type == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError:
            return False
    mod = getattr(torch, device_type, None)
    if device_type == "mps":
        backend = getattr(torch.backends, "mps", None)
        return bool(backend is not None and backend.is_available())
    return bool(mod is not None and hasattr(mod, "is_available") and mod.is_available())


def _vendor(device_type: str) -> str:
    if device_type == "cuda":
        import torch

        return "rocm" if getattr(torch.version, "hip", None) else "nvidia"
    return device_type


def detect_platform(device: str = "auto") -> Platform:
    """Pick the platform: ``device`` (the ``TANDEM_DEVICE`` setting) unless ``auto``, else detect."""
    wanted = device.lower()
    if wanted not in ("auto", *DEVICE_TYPES):
        raise PlatformError(f"TANDEM_DEVICE={wanted!r} is not one of auto, {', '.join(DEVICE_TYPES)}")
    if wanted != "auto":
        if not _available(wanted):
            raise PlatformError(f"TANDEM_DEVICE={wanted!r} was asked for but no such device is available")
        return Platform(wanted, _vendor(wanted))
    for device_type in DEVICE_TYPES:
        if _available(device_type):
            return Platform(device_type, _vendor(device_type))
    return Platform("cpu", "cpu")


@lru_cache(maxsize=8)
def current_platform(device: str | None = None) -> Platform:
    """The platform of this process for the ``device`` setting (detected once per value); None
    takes it from ``CommonSettings`` (the environment), for callers that hold no settings."""
    if device is None:
        from services.common.config import load_common

        device = load_common().device
    return detect_platform(device)


@lru_cache(maxsize=1)
def cpu_flags() -> str:
    """The CPU's flags as Linux lists them (``/proc/cpuinfo``; empty where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's model name as Linux lists it ("AMD EPYC 9R14 ..."), else the platform's word."""
    for line in cpu_flags().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or "unknown"


@lru_cache(maxsize=1)
def cpu_amx_usable() -> bool:
    """Whether this process can use the CPU's AMX tiles (Intel Sapphire Rapids and later): the CPU
    lists ``amx_bf16`` and the Linux kernel grants the tile state (torch asks it, as oneDNN does
    before its AMX kernels; a VM may list AMX yet refuse it). oneDNN's bf16 products run on AMX
    there, and some kernel choices follow (the CPU engine's output head, its prompt products).
    ``ONEDNN_MAX_CPU_ISA`` set below AMX (``AVX512_CORE_BF16``, ``AVX2``, ...) keeps oneDNN off the
    tiles, so the choices then follow what oneDNN will run: no AMX."""
    if " amx_bf16" not in cpu_flags() or not onednn_may_use_amx():
        return False
    import torch

    init_amx = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    return bool(init_amx()) if callable(init_amx) else False


def onednn_may_use_amx(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` (or its older name ``DNNL_MAX_CPU_ISA``) lets oneDNN run its
    AMX kernels: unset, ``ALL``/``DEFAULT``, or an ISA name that includes AMX."""
    env = os.environ if environ is None else environ
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "ALL").strip().upper()
    return cap in ("ALL", "DEFAULT") or "AMX" in cap


def cpu_has_native_bf16() -> bool:
    """Whether the CPU lists native bf16 products (AVX512-BF16 or AMX)."""
    return " avx512_bf16" in cpu_flags() or " amx_bf16" in cpu_flags()


from services.common.platforms.cpu import CpuFeatures, cpu_features  # noqa: E402

__all__ = [
    "DEVICE_TYPES",
    "QUEUE_OF",
    "CpuFeatures",
    "Platform",
    "PlatformError",
    "cpu_amx_usable",
    "cpu_features",
    "cpu_flags",
    "cpu_has_native_bf16",
    "current_platform",
    "detect_platform",
    "onednn_may_use_amx",
]
