"""FlashMask attention vs dense-mask SDPA vs FlexAttention: time and peak memory.

    python -m benchmarks.kernels                       # CPU: 1K-16K tokens, causal + 4 documents
    python -m benchmarks.kernels --lengths 1024 2048 --masks causal docs4 docs1k
    python -m benchmarks.kernels --device cuda         # GPU: 8K-128K tokens, Triton path

Every method runs in its own worker process (``--worker``), one case after another:
one warm-up call (it also compiles FlexAttention), then ``--repeats`` timed calls
(fewer when a call is slow; the count is printed), median reported. Forward and
backward are timed separately inside each call.

Peak memory. On the CPU torch keeps no allocation statistics, so the worker measures
the process's resident set: it starts with ``MALLOC_MMAP_THRESHOLD_=65536`` so every
large buffer is its own mmap and goes back to the OS when freed (RSS then tracks live
memory instead of glibc's cache), resets the kernel's high-water mark
(``/proc/self/clear_refs`` = 5) after the warm-up, and reports ``VmHWM - VmRSS before``
over the timed calls. The measured region includes building the method's mask (dense
``S x S`` bool for SDPA, the BlockMask for FlexAttention, the ``[S, 4]`` bounds for
FlashMask), because a model keeps that mask alive for all its layers. Times exclude it.
On a GPU, ``max_memory_allocated`` above the allocation at the start of the case.

In torch 2.13 FlexAttention has no CPU backward, so on the CPU it is timed forward only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

CPU_LENGTHS = [1024, 2048, 4096, 8192, 16384]
GPU_LENGTHS = [8192, 16384, 32768, 65536, 131072]
MASKS = ("causal", "docs4", "docs1k", "docs-random", "shared-question")
MAX_TIMED_SECONDS = 40.0  # per case: stop repeating once this much was spent


@dataclass
class Result:
    method: str
    length: int
    mask: str
    empty: float  # fraction of (query, key) pairs masked
    fwd_ms: float | None
    bwd_ms: float | None
    peak_mib: float | None
    repeats: int
    note: str = ""


def mask_lengths(kind: str, s: int) -> list[int] | list[tuple[int, int, int]]:
    import random

    if kind == "causal":
        return [s]
    if kind == "docs4":
        return [s // 4] * 3 + [s - 3 * (s // 4)]
    if kind == "docs1k":
        return [1024] * (s // 1024) + ([s % 1024] if s % 1024 else [])
    if kind == "docs-random":
        rng = random.Random(s)
        lens: list[int] = []
        while sum(lens) < s:
            lens.append(min(s - sum(lens), rng.randint(64, max(64, s // 3))))
        return lens
    if kind == "shared-question":
        # DPO packs: prompt 512, chosen 256, rejected 256
        triples = [(512, 256, 256)] * (s // 1024)
        rest = s - 1024 * len(triples)
        return triples + ([(rest, 0, 0)] if rest else [])
    raise ValueError(f"unknown mask {kind!r}; choose from {', '.join(MASKS)}")


def build_mask(kind: str, s: int) -> Any:
    import tandem_kernels

    lens = mask_lengths(kind, s)
    if kind == "shared-question":
        return tandem_kernels.shared_question_mask(lens)  # type: ignore[arg-type]
    return tandem_kernels.document_mask(lens)  # type: ignore[arg-type]


def empty_fraction(kind: str, s: int) -> float:
    from tandem_kernels.flashmask.reference import dense_mask

    if s <= 4096:
        allowed = dense_mask(build_mask(kind, s), causal=True, batch=1, sq=s, sk=s, device=_cpu())
        return 1.0 - allowed.float().mean().item()
    if kind == "shared-question":
        return float("nan")
    lens = [n for n in mask_lengths(kind, s) if isinstance(n, int)]
    return 1.0 - sum(n * (n + 1) / 2 for n in lens) / (s * s)


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


# ----------------------------------------------------------------------------- memory probes


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


class Memory:
    """Peak bytes above the level at ``start()``."""

    def __init__(self, device: str) -> None:
        from services.common.platforms import current_platform

        self.device = device
        self.platform = current_platform()
        self.base = 0

    def start(self) -> None:
        import gc

        gc.collect()
        if self.device == "cpu":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.base = _status("VmRSS:")
        else:
            self.platform.synchronize()
            self.platform.reset_peak_memory()
            self.base = self.platform.max_memory_allocated() or 0

    def peak(self) -> int:
        if self.device == "cpu":
            return _status("VmHWM:") - self.base
        self.platform.synchronize()
        return (self.platform.max_memory_allocated() or 0) - self.base


# ----------------------------------------------------------------------------- methods


def _method(
    name: str, device: str, s: int, kind: str, heads: int, kv_heads: int, d: int, dtype: Any
) -> tuple[Callable[[], Any], Callable[[Any, Any, Any, Any], Any], bool]:
    """(build the mask, attention(q, k, v, mask) in [B, S, H, D], has a backward)."""
    import tandem_kernels
    import torch
    import torch.nn.functional as F
    from tandem_kernels.flashmask.reference import dense_mask

    if name in ("flashmask", "flashmask-torch"):
        from tandem_kernels.flashmask.bounds import normalize_bounds

        impl = "torch" if name == "flashmask-torch" or device == "cpu" else "triton"

        def build() -> Any:
            # the public API normalises the bounds on every call; doing it here too is what a
            # model pays once per batch
            m = build_mask(kind, s).to(device)
            normalize_bounds(m, causal=True, batch=1, sq=s, sk=s, device=m.device)
            return m

        def run(q: Any, k: Any, v: Any, m: Any) -> Any:
            return tandem_kernels.flashmask_attention(q, k, v, m, impl=impl)

        return build, run, True

    if name == "sdpa":

        def build() -> Any:
            return dense_mask(
                build_mask(kind, s).to(device), causal=True, batch=1, sq=s, sk=s, device=torch.device(device)
            )

        def run(q: Any, k: Any, v: Any, m: Any) -> Any:
            return F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=m,
                enable_gqa=heads != kv_heads,
            ).transpose(1, 2)

        return build, run, True

    if name == "flex":
        from tandem_kernels.flashmask.bounds import normalize_bounds
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=True)

        def build() -> Any:
            b = normalize_bounds(
                build_mask(kind, s).to(device), causal=True, batch=1, sq=s, sk=s, device=torch.device(device)
            )[0, 0]
            lts, lte, uts, ute = (b[:, i].contiguous() for i in range(4))

            def mask_mod(bi: Any, h: Any, qi: Any, kv: Any) -> Any:
                # the same column-wise FlashMask bounds, read per (query, key) pair
                return ~(((qi >= lts[kv]) & (qi < lte[kv])) | ((qi >= uts[kv]) & (qi < ute[kv])))

            return create_block_mask(mask_mod, None, None, s, s, device=device)

        def run(q: Any, k: Any, v: Any, m: Any) -> Any:
            return compiled(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                block_mask=m,
                enable_gqa=heads != kv_heads,
            ).transpose(1, 2)

        return build, run, device != "cpu"

    raise ValueError(f"unknown method {name!r}")


def _timed_call(
    platform: Any, run: Any, q: Any, k: Any, v: Any, m: Any, bwd: bool
) -> tuple[float, float | None]:
    """One call: (forward seconds, backward seconds or None)."""
    import torch

    q.grad = k.grad = v.grad = None
    platform.synchronize()
    t0 = time.perf_counter()
    out = run(q, k, v, m)
    platform.synchronize()
    t1 = time.perf_counter()
    if not bwd:
        return t1 - t0, None
    out.backward(torch.ones_like(out))
    platform.synchronize()
    return t1 - t0, time.perf_counter() - t1


def worker(args: argparse.Namespace) -> None:
    import torch

    from services.common.platforms import current_platform

    platform = current_platform()
    dtype = getattr(torch, args.dtype)
    mem = Memory(args.device)
    for s in args.lengths:
        for kind in args.masks:
            empty = empty_fraction(kind, s)
            if args.worker == "sdpa" and s > args.dense_max:
                print(
                    json.dumps(
                        asdict(
                            Result("sdpa", s, kind, empty, None, None, None, 0, "skipped: S x S mask too big")
                        )
                    ),
                    flush=True,
                )
                continue
            build, run, has_bwd = _method(
                args.worker, args.device, s, kind, args.heads, args.kv_heads, args.head_dim, dtype
            )
            gen = torch.Generator().manual_seed(0)
            q, k, v = (
                torch.randn(1, s, h, args.head_dim, generator=gen)
                .to(device=args.device, dtype=dtype)
                .requires_grad_(has_bwd)
                for h in (args.heads, args.kv_heads, args.kv_heads)
            )

            def call(m: Any, run: Any = run, q: Any = q, k: Any = k, v: Any = v, bwd: bool = has_bwd) -> Any:
                return _timed_call(platform, run, q, k, v, m, bwd)

            call(build())  # warm-up (and compilation)
            q.grad = k.grad = v.grad = None
            mem.start()
            m = build()
            times: list[tuple[float, float | None]] = []
            spent = 0.0
            while len(times) < args.repeats and (not times or spent < MAX_TIMED_SECONDS):
                times.append(call(m))
                spent += sum(t for t in times[-1] if t is not None)
            peak = mem.peak()
            del m
            fwd = statistics.median(t[0] for t in times) * 1e3
            bwds = [t[1] for t in times if t[1] is not None]
            bwd = statistics.median(bwds) * 1e3 if bwds else None
            note = "" if has_bwd else "forward only"
            print(
                json.dumps(
                    asdict(Result(args.worker, s, kind, empty, fwd, bwd, peak / 2**20, len(times), note))
                ),
                flush=True,
            )


# ----------------------------------------------------------------------------- driver


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def table(results: list[Result], methods: list[str]) -> str:
    by = {(r.method, r.length, r.mask): r for r in results}
    ours = methods[0]
    names = " / ".join(methods)
    others = " / ".join(methods[1:])
    lines = [
        f"| S | mask | empty | fwd ms ({names}) | fwd: {others} vs {ours} | fwd+bwd ms ({names}) "
        f"| fwd+bwd: {others} vs {ours} | peak MiB ({names}) | peak: {others} vs {ours} |"
    ]
    lines.append("|" + " --- |" * 9)
    keys = sorted({(r.length, r.mask) for r in results}, key=lambda t: (t[0], MASKS.index(t[1])))
    for s, kind in keys:
        rs = [by.get((m, s, kind)) for m in methods]
        base = rs[0]
        if base is None:
            continue
        fwd = " / ".join(_fmt(r.fwd_ms if r else None) for r in rs)
        fwd_r = " / ".join(_ratio(r.fwd_ms if r else None, base.fwd_ms) for r in rs[1:])
        tot = [
            (r.fwd_ms + r.bwd_ms) if r and r.fwd_ms is not None and r.bwd_ms is not None else None for r in rs
        ]
        tot_s = " / ".join(_fmt(t) for t in tot)
        tot_r = " / ".join(_ratio(t, tot[0]) for t in tot[1:])
        peak = " / ".join(_fmt(r.peak_mib if r else None) for r in rs)
        peak_r = " / ".join(_ratio(r.peak_mib if r else None, base.peak_mib) for r in rs[1:])
        lines.append(
            f"| {s} | {kind} | {base.empty:.0%} | {fwd} | {fwd_r} | {tot_s} | {tot_r} | {peak} | {peak_r} |"
        )
    return "\n".join(lines)


def targets(results: list[Result], ours: str) -> list[str]:
    out = []
    by = {(r.method, r.length, r.mask): r for r in results}
    for (method, s, kind), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if method != ours or s != 16384:
            continue
        d = by.get(("sdpa", s, kind))
        if d is None or d.peak_mib is None or r.peak_mib is None or r.bwd_ms is None or d.bwd_ms is None:
            continue
        mem_ok = r.peak_mib <= d.peak_mib / 10
        out.append(
            f"target 16K {kind}: peak {r.peak_mib:.0f} MiB vs dense SDPA {d.peak_mib:.0f} MiB "
            f"(1/{d.peak_mib / max(r.peak_mib, 1e-9):.1f}) -> {'PASS' if mem_ok else 'FAIL'} (needs <= 1/10)"
        )
        if r.empty >= 0.499:  # a causal mask is (S-1)/2S empty: "half"
            ours_t, dense_t = r.fwd_ms + r.bwd_ms, d.fwd_ms + d.bwd_ms  # type: ignore[operator]
            out.append(
                f"target 16K {kind} ({r.empty:.0%} empty): fwd+bwd {ours_t:.0f} ms vs dense SDPA {dense_t:.0f} ms "
                f"-> {'PASS' if ours_t <= dense_t else 'FAIL'} (needs no slower)"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--lengths", type=int, nargs="+")
    p.add_argument("--masks", nargs="+", default=["causal", "docs4"], choices=MASKS)
    p.add_argument("--methods", nargs="+", help="default: flashmask sdpa flex")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dense-max", type=int, default=None, help="longest S for dense SDPA (its mask is S x S)")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.lengths = args.lengths or (CPU_LENGTHS if args.device == "cpu" else GPU_LENGTHS)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.dense_max = args.dense_max or (16384 if args.device == "cpu" else 32768)
    methods = args.methods or ["flashmask", "sdpa", "flex"]
    if args.worker:
        worker(args)
        return 0

    import torch

    print(
        f"# kernels: B=1, heads {args.heads}/{args.kv_heads}, head dim {args.head_dim}, {args.dtype}, "
        f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: list[Result] = []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for method in methods:
        cmd = [sys.executable, "-m", "benchmarks.kernels", "--worker", method, *_passthrough(args)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            r = Result(**json.loads(line))
            results.append(r)
            print(
                f"  {r.method:>15} S={r.length:>6} {r.mask:<15} fwd {_fmt(r.fwd_ms)} ms  bwd {_fmt(r.bwd_ms)} ms  "
                f"peak {_fmt(r.peak_mib)} MiB  n={r.repeats} {r.note}",
                flush=True,
            )
        if proc.wait() != 0:
            print(f"  {method}: worker failed (exit {proc.returncode})", flush=True)
    print()
    print(table(results, methods))
    print()
    for line in targets(results, methods[0]):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = ["--device", args.device, "--lengths", *map(str, args.lengths), "--masks", *args.masks]
    out += ["--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim)]
    out += ["--dtype", args.dtype, "--repeats", str(args.repeats), "--dense-max", str(args.dense_max)]
    return out


if __name__ == "__main__":
    sys.exit(main())
