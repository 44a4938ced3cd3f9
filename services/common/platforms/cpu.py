"""What the CPU offers the engine's kernels: one typed record, probed once per process.

The CPU engine picks kernels by the instruction sets torch runs here (``AVX2``/``AVX512``: the
C++ decode kernels' vectors), by what ``/proc/cpuinfo`` lists (native bf16 products: AVX512-BF16
or AMX; int8 sums: AVX512-VNNI) and by whether the Linux kernel lets this process use the AMX tiles. Every such probe is
here; the engine reads the record (``cpu_features()``), and a test or a benchmark may hand the
plan resolver another one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class CpuFeatures:
    # torch's CPU kernel level: "DEFAULT", "AVX2", "AVX512" (torch.backends.cpu.get_cpu_capability)
    capability: str
    avx2: bool  # torch runs AVX2 (or AVX-512) kernels here
    avx512_bf16: bool  # listed by /proc/cpuinfo
    amx_bf16: bool  # listed by /proc/cpuinfo
    # listed, the Linux kernel grants this process the tile state, and ONEDNN_MAX_CPU_ISA allows it
    amx_usable: bool
    avx512_vnni: bool  # AVX512-VNNI and AVX512BW listed by /proc/cpuinfo (q4_linear's wide kernels)
    onednn: bool  # this torch build has oneDNN (mkldnn)

    @property
    def native_bf16(self) -> bool:
        """Native bf16 products (AVX512-BF16 or AMX): bf16 matmuls faster than fp32 ones."""
        return self.avx512_bf16 or self.amx_bf16

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "native_bf16": self.native_bf16}


def probe() -> CpuFeatures:
    """The record as the CPU and this torch build say now (uncached: ``cpu_features`` caches it)."""
    import torch

    from services.common import platforms

    flags = platforms.cpu_flags()
    capability = str(torch.backends.cpu.get_cpu_capability())
    return CpuFeatures(
        capability=capability,
        avx2=capability in ("AVX2", "AVX512"),
        avx512_bf16=" avx512_bf16" in flags,
        amx_bf16=" amx_bf16" in flags,
        amx_usable=platforms.cpu_amx_usable(),
        avx512_vnni=" avx512_vnni" in flags and " avx512bw" in flags,
        onednn=bool(torch.backends.mkldnn.is_available()),  # type: ignore[no-untyped-call]
    )


@lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This process's CPU features (probed on the first call)."""
    return probe()
