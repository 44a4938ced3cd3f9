"""The Triton kernels compile (ahead of time, no GPU needed) for an NVIDIA sm_90 target, in
every dtype and head dim the launcher uses, and fit in its shared memory. The interpreter
tests check the arithmetic; this checks what only the compiler sees (types across dynamic
branches, dot shapes, constexpr use)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

import tandem_kernels.flashmask.triton_impl as ti  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

if ti.INTERPRETED:
    pytest.skip("kernels were built for the interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

H100_SHARED = 227 * 1024
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _compile(fn, pointers: dict[str, str], consts: dict, warps: int, stages: int):  # type: ignore[no-untyped-def]
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name.startswith("scale") else "i32"
    try:
        return triton.compile(
            ASTSource(fn, sig, consts),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "num_stages": stages},
        )
    except RuntimeError as e:  # no ptxas or backend in this triton build
        if "ptxas" in str(e).lower():
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernels_compile_for_sm90(dtype: torch.dtype, d: int) -> None:
    t = TYPES[dtype]
    cfg = ti._blocks(d, dtype, interpret=False)
    prec = ti._precision(dtype)
    fwd = _compile(
        ti._fwd_kernel,
        {
            "Q": f"*{t}",
            "K": f"*{t}",
            "V": f"*{t}",
            "Bnd": "*i32",
            "Stats": "*i32",
            "Out": f"*{t}",
            "Lse": "*fp32",
        },
        {
            "CAUSAL": True,
            "HEAD_DIM": d,
            "BLOCK_M": cfg["fwd_m"],
            "BLOCK_N": cfg["fwd_n"],
            "DOT_PRECISION": prec,
        },
        cfg["warps"],
        cfg["stages"],
    )
    assert fwd.metadata.shared <= H100_SHARED
    bwd_ptrs = {
        "Q": f"*{t}",
        "K": f"*{t}",
        "V": f"*{t}",
        "DO": f"*{t}",
        "Lse": "*fp32",
        "Delta": "*fp32",
        "Bnd": "*i32",
        "Stats": "*i32",
        "DK": f"*{t}",
        "DV": f"*{t}",
    }
    common = {"HEAD_DIM": d, "BLOCK_M": cfg["bwd_m"], "BLOCK_N": cfg["bwd_n"], "DOT_PRECISION": prec}
    dkdv = _compile(
        ti._bwd_dkdv_kernel,
        {**bwd_ptrs, "DQ": "*fp32"},
        {"CAUSAL": False, "ATOMIC_DQ": True, **common},
        cfg["warps"],
        cfg["stages"],
    )
    dq = _compile(
        ti._bwd_dq_kernel,
        {**bwd_ptrs, "DQ": f"*{t}"},
        {"CAUSAL": True, **common},
        cfg["warps"],
        cfg["stages"],
    )
    assert dkdv.metadata.shared <= H100_SHARED and dq.metadata.shared <= H100_SHARED
