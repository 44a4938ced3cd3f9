"""Weight-only int8 / int4 linear layers for the CPU engine (``TANDEM_INFERENCE_QUANTIZE``).

A decode step on a CPU is bound by reading the weights: at one to a few rows per product,
each weight element is used once per row. Quantised weights read 4x (int8) or 8x (int4)
fewer bytes than fp32. The products run through torch's own CPU kernels for weight-only
quantisation, ``aten._weight_int8pack_mm`` and ``aten._weight_int4pack_mm_for_cpu`` (what
torchao's CPU weight-only layouts call), with bf16 activations: their fp32 paths are
slower than fp32 itself. Measured on 2 Zen 4 cores, one thread, the 211 products of one
SmolLM2-135M step (30 layers and the output head), median of 5 interleaved rounds on a
shared, loaded machine (ratios, not absolute times, are the point):

    rows   fp32 packed   bf16 packed   int8 (bf16 act.)   int4 g32 (bf16 act.)
    1         54 ms         31 ms          25 ms               14 ms
    4         52            28             27                  20
    16        90            54             79                  65

So int4 wins where serving spends its time (few rows per step), and int8 gains little. Where
the native module is built, the layers' int4 decode products are
the engine's own instead (``Int4Blocks``: the weights' Q4_1 values exactly, each row's inputs as
int8 in groups of 32, integer sums, as llama.cpp multiplies a Q4_1 file): about 2.9x torch's
kernel at one row and 3.1x at 16 on 2 Zen 4 cores (AVX2 alone: 2.1x and 1.6x).

**Why int4 with groups of 32 and a minimum** (asymmetric, ``w = (q - 8) * scale + zero``):
it is GGUF's Q4_1 block format. The default model ships as a Q4_1 GGUF, so its decoder
weights *are* 4-bit values in blocks of 32 with a scale and a minimum: re-quantising the
de-quantised fp32 weights this way gives them back exactly (relative error 0 with fp32
scales; 0.2% from the kernel's bf16 scales). Q4_0 and Q4_K blocks are the same shape (Q4_K's
sub-blocks of 32 with scale ``d * sc`` and minimum ``dmin * m``), though a group's own minimum and
maximum do not find their scales: the loader registers a GGUF's groups and ``q4_1_groups`` takes
them for the rows that hold the file's values (``gguf_weights``). The output head (tied to the token
embeddings, stored at higher precision in the file: int4 would be a 9% error, int8 1.2%)
runs in bf16, oneDNN-packed (0.4%; see ``layer_kernels`` for its timings).

The model keeps its fp32 weights and stays fp32 everywhere else (norms, residual stream,
attention, KV cache): only the layers' products change, inside the engine's forwards
(``packed_linear.PackedLinears`` swaps the forwards in and out), so PEFT's LoRA layers
(their A/B matrices stay fp32), the trainer, ``state_dict`` and deep copies see plain
modules, and a weight the trainer changed in place is quantised again. Where oneDNN has AMX
only decode tokens use the quantised weights; prompt tokens multiply with packed unquantised ones
(``ByTokenKind``: faster for many rows), in the decoder layers in bf16 by default
(``resolve_prompt_dtype``: a prompt forward about 1.7x faster than fp32), the output head's
prompt rows in fp32; without AMX, prompt rows take the own int4 / Q8_0 blocks times int8 rows
as decode rows do (faster there than oneDNN's bf16 or fp32, and no second copy of the weights). The head matters most for the first token: with it in bf16 too, SmolLM2
answered "What is the capital of France?" with "L'Étoile, la Marseillaise, ..." (as llama.cpp's
Q4_1 does) instead of "The capital of France is Paris."; with it in fp32, 24 of 24 test prompts
keep the fp32 prompt's first token (``TANDEM_INFERENCE_PROMPT_DTYPE=float32`` keeps the
prompt's keys/values and first token exactly the fp32 model's).

Greedy output is deterministic and independent of the batch, bit for bit: each row's product is computed the same way whatever the number of rows (the int4
kernel, measured, and oneDNN's: ``OneDNNPacked`` pairs a lone row in the layers where
oneDNN's lone-row path differs), and so is each token's attention (``ragged.invariant_attention``); the bf16
activations would otherwise turn a last-bit difference into another token
(``test_quantized_engine.py``, ``test_ragged.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from services.common.platforms import CpuFeatures, cpu_features
from services.inference.engine import packed_linear, ragged
from services.inference.engine.packed_linear import KernelChoice, LinearKernel, OneDNNPacked

log = logging.getLogger("tandem.engine.quantized_linear")

Quantize = Literal["auto", "none", "int8", "int4"]
# the dtype prompt tokens multiply in (``TANDEM_INFERENCE_PROMPT_DTYPE``; see ``resolve_prompt_dtype``)
PromptDType = Literal["auto", "float32", "bfloat16", "int8"]

# auto picks int4 when re-quantising loses at most this (relative, per layer): weights that
# came from a 4-bit GGUF (Q4_0/Q4_1/Q4_K: the file's own groups, ``gguf_weights``) come back with
# 0; other weights lose ~8% (SmolLM2 fp32)
LOSSLESS_INT4 = 1e-3

# GGUF's Q4_0/Q4_1 block size; torch's CPU int4 kernel takes 32, 64, 128 or 256
INT4_GROUP = 32
# the kernels' activation dtype (their fp32 paths are 4-10x slower than fp32 itself)
COMPUTE_DTYPE = torch.bfloat16


class Int8WeightOnly:
    """Symmetric int8 per output channel."""

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return q.contiguous(), scale.to(COMPUTE_DTYPE)

    def apply(self, input: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = prepared
        x = input.reshape(-1, input.shape[-1]).to(COMPUTE_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(x, q, scale).to(input.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*input.shape[:-1], -1)


def q4_1_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] in GGUF's Q4_1 groups of ``INT4_GROUP`` inputs, ``w ~ q * scale + low``:
    q [out, in / group, group] (0..15, as fp32), scale and low [out, in / group] in fp32. Rows
    of a registered GGUF's Q4_0 / Q4_1 / Q4_K tensors take the file's own groups (its values bit
    for bit, ``gguf_weights.file_groups``); other rows each group's minimum and maximum."""
    q, scale, low, _from_file = _groups(weight)
    return q, scale, low


def _groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q4_1_groups`` and which rows [out] took a file's groups."""
    from services.inference.engine import gguf_weights

    w = weight.detach().float()
    out_f, in_f = w.shape
    kept = gguf_weights.file_groups(w)
    if kept is not None and bool(kept[3].all()):
        return kept[0], kept[1], kept[2], kept[3]
    groups = w.reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    if kept is None:
        return q, scale, low, torch.zeros(out_f, dtype=torch.bool)
    file_q, file_scale, file_low, found = kept
    q[found], scale[found], low[found] = file_q[found], file_scale[found], file_low[found]
    return q, scale, low, found


class Int4WeightOnly:
    """Asymmetric int4 in groups of ``INT4_GROUP`` input features (GGUF's Q4_1 format)."""

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out_f, in_f = weight.shape
        q, scale, low = q4_1_groups(weight)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(out_f, in_f), 1)
        # the kernel computes (q - 8) * scale + zero, so zero is the value of q = 8
        zero = low + 8 * scale
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
        return packed, scales_zeros.to(COMPUTE_DTYPE)

    def apply(self, input: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        x = self.rows(input.reshape(-1, input.shape[-1]))
        out = self.product(x, prepared).to(input.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*input.shape[:-1], -1)

    def rows(self, input: torch.Tensor) -> torch.Tensor:
        return input.to(COMPUTE_DTYPE)

    def product(self, rows: torch.Tensor, prepared: Any) -> torch.Tensor:
        packed, scales_zeros = prepared
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, INT4_GROUP, scales_zeros)


# outputs a tile of Int4Blocks' layout (native.q4_linear's: one AVX-512 vector of fp32 lanes)
Q4_TILE = 16


# Int4Blocks' super-blocks: groups whose scales (and, apart, minima) share an fp32 base per output
Q4_SUPER = 8
# the multipliers tried for a super-block of a file's groups that are not fp16 values already: Q4_K's
# scales and minima are an fp16 value times 6-bit integers, the largest 63 as its quantiser leaves it
Q4_K_LEVELS = 63
# the largest one-byte multiplier (``Multipliers`` "int8"), either sign
INT8_LEVELS = 127
# a super-block's multipliers of its groups' scales and minima: fp16 (5.25 bits a weight; Q4_0's and
# Q4_1's fp16 values exactly) or int8 (4.75 bits; Q4_K's 6-bit integers exactly)
Multipliers = Literal["fp16", "int8"]
# rounding of an int8 multiplier that is not exact: "down" and "up" keep a group's range inside the
# held minimum and scale (``Int4Blocks.prepare``)
Rounding = Literal["nearest", "down", "up"]


def fp16_factors(
    values: torch.Tensor, searched: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``values`` [rows, groups] (fp32) as ``base * multiplier`` per super-block of ``Q4_SUPER``
    groups: base [rows, S] fp32, multipliers [rows, S * Q4_SUPER] fp16 (the last super-block padded
    with zeros), and which super-blocks are exact (``base * multiplier == value`` in fp32 for
    each). Exact where the values are fp16 (base 1: Q4_0's and Q4_1's) or, in the rows
    ``searched`` [rows] names (a file's), an fp16 base times integers up to ``Q4_K_LEVELS`` (Q4_K's,
    found by trying the largest value over each count of levels: up to 63 passes, so only where a
    file's values can be); elsewhere the base is the super-block's largest magnitude, its
    multipliers rounded (a relative 2^-11 at most)."""
    return _factors(values, searched, "fp16", "nearest")


def int8_factors(
    values: torch.Tensor, searched: torch.Tensor | None = None, rounding: Rounding = "nearest"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp16_factors`` with int8 multipliers: exact where the rows ``searched`` names hold a base
    times integers up to ``Q4_K_LEVELS`` (Q4_K's scales and minima); elsewhere the base is the
    super-block's largest magnitude over ``INT8_LEVELS`` and each multiplier rounded as
    ``rounding`` says (at most a 127th of the largest value off)."""
    return _factors(values, searched, "int8", rounding)


def _factors(
    values: torch.Tensor, searched: torch.Tensor | None, multipliers: Multipliers, rounding: Rounding
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, groups = values.shape
    supers = -(-groups // Q4_SUPER)
    v = torch.nn.functional.pad(values.float(), (0, supers * Q4_SUPER - groups)).view(rows, supers, Q4_SUPER)

    def held(ratio: torch.Tensor, how: Rounding = "nearest") -> torch.Tensor:
        if multipliers == "fp16":
            return ratio.to(torch.float16)
        rounded = (
            torch.floor(ratio) if how == "down" else torch.ceil(ratio) if how == "up" else torch.round(ratio)
        )
        return rounded.clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)

    # base 1: exact where the values are fp16 values (Q4_0's, Q4_1's), or integers for int8 (zeros)
    base = torch.ones(rows, supers)
    mult = held(v)
    exact = (mult.float() == v).all(dim=-1)
    top = v.abs().amax(dim=-1)
    tried = searched if searched is not None else torch.zeros(rows, dtype=torch.bool)
    for levels in range(Q4_K_LEVELS, 0, -1) if bool(tried.any()) else ():
        todo = (~exact & tried[:, None]).nonzero(as_tuple=True)
        if not todo[0].numel():
            break
        b = top[todo] / levels
        m = held(v[todo] / b[:, None])
        ok = (b[:, None] * m.float() == v[todo]).all(dim=-1)
        hit = tuple(i[ok] for i in todo)
        base[hit], mult[hit], exact[hit] = b[ok], m[ok], True
    rest = (~exact).nonzero(as_tuple=True)
    if rest[0].numel():
        levels = 1 if multipliers == "fp16" else INT8_LEVELS
        b = torch.where(top[rest] > 0, top[rest] / levels, 1.0)
        base[rest], mult[rest] = b, held(v[rest] / b[:, None], rounding)
    return base, mult.view(rows, supers * Q4_SUPER), exact


def _scale_blob(
    scale: tuple[torch.Tensor, torch.Tensor], low: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Each group's scale and minimum (``fp16_factors``' or ``int8_factors``' bases [out, S] and
    multipliers [out, S * Q4_SUPER]) in the native kernels' layout: per tile of ``Q4_TILE`` outputs
    and super-block, [2, 16] fp32 bases (scales, minima), then [Q4_SUPER, 2, 16] multipliers;
    [tiles, S * 640] bytes with fp16 multipliers, [tiles, S * 384] with int8 ones."""
    out_f, supers = scale[0].shape
    tiles = out_f // Q4_TILE
    bases = torch.stack([scale[0], low[0]], dim=1).view(tiles, Q4_TILE, 2, supers).permute(0, 3, 2, 1)
    mults = (
        torch.stack([scale[1], low[1]], dim=1)
        .view(tiles, Q4_TILE, 2, supers, Q4_SUPER)
        .permute(0, 3, 4, 2, 1)
    )
    blob = torch.cat(
        [
            bases.contiguous().view(torch.uint8).reshape(tiles, supers, -1),
            mults.contiguous().view(torch.uint8).reshape(tiles, supers, -1),
        ],
        dim=2,
    )
    return blob.reshape(tiles, -1)


def blob_multipliers(blob: torch.Tensor, groups: int) -> Multipliers:
    """Which multipliers a ``_scale_blob`` of ``groups`` groups an output holds (by its size)."""
    per_super = blob.shape[1] // -(-groups // Q4_SUPER)
    return "fp16" if per_super == 2 * Q4_TILE * 4 + Q4_SUPER * 2 * Q4_TILE * 2 else "int8"


def _blob_values(blob: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_scale_blob``'s scales and minima back, [out, groups] fp32 each (base times multiplier, as
    the kernels compute them)."""
    dtype = torch.float16 if blob_multipliers(blob, groups) == "fp16" else torch.int8
    tiles, supers = blob.shape[0], -(-groups // Q4_SUPER)
    parts = blob.view(tiles, supers, -1)
    bases = parts[..., : 2 * Q4_TILE * 4].contiguous().view(torch.float32).view(tiles, supers, 2, Q4_TILE)
    mults = parts[..., 2 * Q4_TILE * 4 :].contiguous().view(dtype).view(tiles, supers, Q4_SUPER, 2, Q4_TILE)
    values = bases[:, :, None] * mults.float()  # [tile, super, group, 2, c]
    values = values.permute(0, 4, 3, 1, 2).reshape(tiles * Q4_TILE, 2, supers * Q4_SUPER)[..., :groups]
    return values[:, 0].contiguous(), values[:, 1].contiguous()


def _per_group(base: torch.Tensor, mult: torch.Tensor, groups: int) -> torch.Tensor:
    """``fp16_factors``' (or ``int8_factors``') bases and multipliers as each group's value [rows,
    groups] in fp32."""
    return base.repeat_interleave(Q4_SUPER, dim=1)[:, :groups] * mult[:, :groups].float()


def _int4_factors(
    scale: torch.Tensor, low: torch.Tensor, from_file: torch.Tensor, multipliers: Multipliers | None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Each group's scale and minimum as bases and multipliers, and which super-blocks [out, S]
    hold ``scale`` and ``low`` exactly. ``multipliers`` None: int8 multipliers (4.75 bits a weight,
    10% fewer bytes than fp16's 5.25: a decode step reads every byte) unless they would lose
    values that fp16 ones keep: a file's rows (Q4_0's and Q4_1's fp16 scales), or a weight whose
    every group fp16 holds (such a file's values de-quantised, served from a folder); fp16
    multipliers then, as everywhere for Q8_0. Groups int8 does not hold exactly keep their range:
    the minimum rounded down, then the scale that still reaches the group's top rounded up (their
    values are quantised again with them)."""
    groups = scale.shape[1]
    low_base, low_mult, low_exact = int8_factors(low, from_file, "down")
    fp16 = None  # the fp16 factors of scale and low, made once where both choosing and holding need them
    if multipliers is None:
        fp16 = fp16_factors(scale, from_file), fp16_factors(low, from_file)
        int8_exact = low_exact & int8_factors(scale, from_file)[2]
        fp16_exact = fp16[0][2] & fp16[1][2]
        file_lost = bool((from_file[:, None] & ~int8_exact).any())
        multipliers = "fp16" if file_lost or bool(fp16_exact.all() & ~int8_exact.all()) else "int8"
    if multipliers == "fp16":
        (s_base, s_mult, s_exact), (l_base, l_mult, l_exact) = fp16 or (
            fp16_factors(scale, from_file),
            fp16_factors(low, from_file),
        )
        return (s_base, s_mult), (l_base, l_mult), s_exact & l_exact
    held_low = _per_group(low_base, low_mult, groups)
    kept = low_exact.repeat_interleave(Q4_SUPER, dim=1)[:, :groups]
    reach = torch.where(kept, scale, (low + 15 * scale - held_low) / 15)
    scale_base, scale_mult, scale_exact = int8_factors(reach, from_file, "up")
    return (scale_base, scale_mult), (low_base, low_mult), scale_exact & low_exact


class Int4Blocks(Int4WeightOnly):
    """Int4 in GGUF's Q4_1 groups (``w = q * scale + min``; each group's scale and min an fp32 base
    of its super-block times a multiplier, ``_int4_factors``: int8 multipliers, 4.75 bits a weight
    and Q4_K's values exactly, or fp16 ones where a Q4_0 or Q4_1 file's values need them, 5.25
    bits; ``Int4WeightOnly``'s bf16 scales round them, fp32 scales and minima took 6 bits), multiplied by the native module's
    ``q4_linear`` with each row's inputs quantised to int8 in groups of 32, as llama.cpp's Q4_1 x
    Q8_1 product does: a group's sum is exact int32 arithmetic (AVX512-VNNI's ``vpdpbusd``, 64
    products an instruction, where the CPU has it; AVX2's ``maddubs`` elsewhere, the same numbers
    bit for bit), so each row's numbers are the same alone as in any batch. SmolLM2-135M's four
    decode products of a layer on 2 Zen 4 cores: 1 row 43 (AVX2: 59) vs 124 us for torch's int4
    kernel, 16 rows 229 (425) vs 700 us (``benchmarks/RESULTS.md``). The plan picks it where the
    native module is built, for each layer whose outputs are whole tiles of ``Q4_TILE``."""

    # the multipliers every weight takes (None: as ``_int4_factors`` picks): a benchmark's baseline
    multipliers: Multipliers | None = None

    def prepare(
        self, weight: torch.Tensor, multipliers: Multipliers | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed values and the scales' blob (``multipliers``: the ones asked for, else the
        class's, else as ``_int4_factors`` picks)."""
        multipliers = multipliers or self.multipliers
        out_f, in_f = weight.shape
        if in_f % INT4_GROUP or out_f % Q4_TILE:
            raise ValueError(
                f"Int4Blocks: a {out_f} x {in_f} weight is not whole {Q4_TILE} x {INT4_GROUP} tiles"
            )
        q_float, scale, low, from_file = _groups(weight)
        groups = in_f // INT4_GROUP
        scale_factors, low_factors, exact = _int4_factors(scale, low, from_file, multipliers)
        inexact = (~exact).repeat_interleave(Q4_SUPER, dim=1)[:, :groups]
        if inexact.any():  # the rounded scales and minima: their groups quantised again with them
            held_scale = _per_group(*scale_factors, groups)
            held_low = _per_group(*low_factors, groups)
            w = weight.detach().float().view(out_f, groups, INT4_GROUP)
            again = torch.round((w - held_low[..., None]) / held_scale.clamp(min=1e-12)[..., None]).clamp(
                0, 15
            )
            q_float = torch.where(inexact[..., None], again, q_float.view(out_f, groups, INT4_GROUP))
        q = q_float.reshape(out_f, in_f).to(torch.uint8)
        # per tile and pair p of quads (8 inputs), byte 4c + i: output c's input 8p + i (low nibble)
        # and 8p + 4 + i (high): one mask and one shift unpack two quads for vpdpbusd
        quads = q.view(out_f // Q4_TILE, Q4_TILE, in_f // 8, 2, 4)
        packed = (quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
        blob = _scale_blob(scale_factors, low_factors)
        return packed.view(out_f // Q4_TILE, in_f // 4, 2 * Q4_TILE), blob

    @staticmethod
    def held(prepared: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What ``prepare`` holds: ``q`` [out, in] (0..15), each group's scale and minimum [out,
        groups] in fp32 (base times multiplier, as the kernel computes them)."""
        packed, blob = prepared
        tiles, in_f = packed.shape[0], packed.shape[1] * 4
        out_f, groups = tiles * Q4_TILE, in_f // INT4_GROUP
        # byte 4c + i of (tile, pair p): output c's input 8p + i (low nibble) and 8p + 4 + i (high)
        pairs = packed.view(tiles, in_f // 8, Q4_TILE, 4)
        q = torch.stack([pairs & 0x0F, pairs >> 4], dim=2).permute(0, 3, 1, 2, 4).reshape(out_f, in_f)
        return (q, *_blob_values(blob, groups))

    def rows(self, input: torch.Tensor) -> torch.Tensor:
        return input.float().contiguous()

    def product(self, rows: torch.Tensor, prepared: Any) -> torch.Tensor:
        from services.inference.engine import native

        kernel = native.q4_linear()
        if kernel is None:  # chosen only once the module is built (plan.resolve_plan)
            raise RuntimeError("Int4Blocks needs the native module's q4_linear (native.start)")
        packed, scale_min = prepared
        return kernel(rows, packed, scale_min)


# the output head's Q8_0 kernels (plan.resolve_plan): Q8Blocks (fp32 rows), Q8Rows (int8 rows); None: neither
Q8Head = Literal["q8_0", "q8_0-int8"] | None
Q8_HEADS = ("q8_0", "q8_0-int8")
# GGUF's Q8_0 block size (Q8Blocks), and its output tiles (native.q8_linear's layout)
Q8_BLOCK = 32
Q8_TILE = 32


class Q8Blocks:
    """Symmetric int8 in blocks of ``Q8_BLOCK`` input features with an fp32 scale each (GGUF's
    Q8_0), multiplied with fp32 activations by the native module's ``q8_linear`` (AVX2). For the
    output head's decode rows: the default model file stores its head (the tied embeddings) as
    Q8_0, so re-quantising the de-quantised weight gives the file's values back, where bf16
    rounds them; and it reads about half a bf16 head's bytes (SmolLM2's 49K x 576 head at one row:
    1.7-2.3 vs 4.7-5.7 ms on 2 Zen 4 cores; 16 rows 15-19 vs 7.5-9.3 ms). Each row is computed on
    its own (the same logits alone as in any batch)."""

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        w = weight.float()
        out_f, in_f = w.shape
        if in_f % Q8_BLOCK:
            raise ValueError(f"Q8Blocks: {in_f} input features are not a multiple of {Q8_BLOCK}")
        tiles = -(-out_f // Q8_TILE)
        if tiles * Q8_TILE != out_f:  # zero rows up to whole tiles (their outputs are dropped)
            w = torch.cat([w, w.new_zeros(tiles * Q8_TILE - out_f, in_f)])
        blocks = w.view(tiles * Q8_TILE, in_f // Q8_BLOCK, Q8_BLOCK)
        scale = blocks.abs().amax(dim=-1) / 127
        q = (
            torch.round(blocks / torch.where(scale > 0, scale, 1.0)[..., None])
            .clamp(-127, 127)
            .to(torch.int8)
        )
        # tiles of Q8_TILE outputs: an input's weights in a tile are consecutive bytes
        q_tiles = q.view(tiles, Q8_TILE, in_f).transpose(1, 2).contiguous()
        scale_tiles = scale.view(tiles, Q8_TILE, in_f // Q8_BLOCK).transpose(1, 2).contiguous()
        return q_tiles, scale_tiles, out_f

    def apply(self, input: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        from services.inference.engine import native

        q_tiles, scale_tiles, out_f = prepared
        kernel = native.q8_linear()
        if kernel is None:  # chosen only once the module is built (ModelRunner)
            raise RuntimeError("Q8Blocks needs the native module's q8_linear (native.start)")
        x = input.reshape(-1, input.shape[-1])
        out = kernel(x, q_tiles, scale_tiles)[:, :out_f].to(input.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*input.shape[:-1], -1)


class Q8Rows:
    """GGUF's Q8_0 (int8 in blocks of 32 inputs, a scale each: base times fp16 multiplier as in
    ``Int4Blocks``, the file's fp16 values exactly) times each row's inputs as int8 in blocks of 32,
    as llama.cpp multiplies a Q8_0 head (Q8_0 x Q8_0): exact int32 sums by AVX512-VNNI, each row
    alone (the same logits alone as in any batch). For the output head's decode rows: half a bf16
    head's bytes, and at 16 rows 64 products an instruction where ``Q8Blocks``' fp32 FMAs do 16."""

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        w = weight.detach().float()
        out_f, in_f = w.shape
        if in_f % Q8_BLOCK:
            raise ValueError(f"Q8Rows: {in_f} input features are not a multiple of {Q8_BLOCK}")
        padded = -(-out_f // Q4_TILE) * Q4_TILE
        if padded != out_f:  # zero rows up to whole tiles (their outputs are dropped)
            w = torch.cat([w, w.new_zeros(padded - out_f, in_f)])
        groups = in_f // Q8_BLOCK
        blocks = w.view(padded, groups, Q8_BLOCK)
        base, mult, _ = fp16_factors(blocks.abs().amax(dim=-1) / 127)
        held = _per_group(base, mult, groups)[..., None]
        q = torch.round(blocks / torch.where(held > 0, held, 1.0)).clamp(-127, 127)
        # byte 4c + i of (tile, quad j): output c's input 4j + i, as q + 128
        unsigned = (q + 128).to(torch.uint8).view(padded // Q4_TILE, Q4_TILE, in_f // 4, 4)
        packed = unsigned.permute(0, 2, 1, 3).reshape(padded // Q4_TILE, in_f // 4, 4 * Q4_TILE).contiguous()
        # w = (u - 128) * scale: the minimum is -128 times the scale (exact in fp16)
        return packed, _scale_blob((base, mult), (base, mult * -128)), out_f

    @staticmethod
    def held(prepared: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
        """The weight ``prepare`` holds, [out, in] fp32: each value times its block's scale (base
        times multiplier, as the kernel computes it)."""
        packed, blob, out_f = prepared
        tiles, quads = packed.shape[:2]
        # byte 4c + i of (tile, quad j): output c's input 4j + i, as q + 128
        q = packed.view(tiles, quads, Q4_TILE, 4).permute(0, 2, 1, 3).reshape(tiles * Q4_TILE, quads * 4)
        scale = _blob_values(blob, quads * 4 // Q8_BLOCK)[0]
        return ((q.float() - 128).view(tiles * Q4_TILE, -1, Q8_BLOCK) * scale[..., None]).view(
            tiles * Q4_TILE, -1
        )[:out_f]

    def apply(self, input: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.product(self.rows(input.reshape(-1, input.shape[-1])), prepared).to(input.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*input.shape[:-1], -1)

    # the lean forwards' two steps (``RowKernel``): the rows in fp32 (quantised by the kernel), the product
    def rows(self, input: torch.Tensor) -> torch.Tensor:
        return input.float().contiguous()

    def product(self, rows: torch.Tensor, prepared: Any) -> torch.Tensor:
        from services.inference.engine import native

        packed, blob, out_f = prepared
        kernel = native.q8_rows()
        if kernel is None:  # chosen only once the module is built (plan.resolve_plan)
            raise RuntimeError("Q8Rows needs the native module's q8_rows (native.start)")
        out = kernel(rows, packed, blob)
        return out if out.shape[1] == out_f else out[:, :out_f]


class BF16Packed(OneDNNPacked):
    """The weight in bf16, oneDNN-packed (native bf16 products on CPUs with AVX512-BF16/AMX)."""

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return super().prepare(weight.to(COMPUTE_DTYPE))

    def apply(self, input: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        out = super().apply(input.to(COMPUTE_DTYPE), prepared, None).to(input.dtype)
        return out if bias is None else out + bias

    def rows(self, input: torch.Tensor) -> torch.Tensor:
        return input.to(COMPUTE_DTYPE)

    def product(self, rows: torch.Tensor, prepared: Any) -> torch.Tensor:
        return OneDNNPacked.apply(self, rows, prepared, None)


# bf16 prompt products run in blocks of a whole number of this many rows (``BlockedBF16``)
PROMPT_BLOCK = 64
# and of at most this many, where a layer's probe finds each row's bits the same in such blocks
PROMPT_BLOCK_MAX = 192


class BlockedBF16(BF16Packed):
    """Prompt tokens' products in bf16, in blocks of a whole number of ``PROMPT_BLOCK`` rows (the
    last one padded with zeros), one oneDNN product per block. oneDNN's bf16 kernels pick their
    blocking by the row count, and a row's result moves with it (an AMX/AVX512-BF16 Xeon:
    SmolLM2's 1536 -> 576 product of the same row differed between 240 rows and 32, and a
    prompt's greedy tokens alone and in a batch of 16 with it); in a block of ``PROMPT_BLOCK``
    rows each row's result depends on that row alone, neither on the other rows nor on its place
    among them (measured on every SmolLM2 shape, and probed for each layer when its weight is
    prepared). So a prompt token's numbers do not depend on what shares its forward.

    Larger blocks are faster (an AMX Xeon, SmolLM2's four side-by-side products of 256 rows: 46 ms
    in 64-row blocks, 34 in 128 or 192 + 64, 30 in one block of 256, over 30 layers), and on such
    a CPU blocks of 64, 128 and 192 rows gave every row the same bits (256 did not, for the
    1536 -> 576 product). So each layer is probed when prepared (``_block_rows``): where blocks of
    up to ``PROMPT_BLOCK_MAX`` rows give each row its 64-row block's bits at any place, its
    products take blocks that large; elsewhere blocks of exactly ``PROMPT_BLOCK``. Either way a
    row's numbers are the same in every block it can land in."""

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, Any]:  # (packed, rows a block)
        packed, _ = super().prepare(weight)
        block = _block_rows(packed, weight.shape[1])
        if not block:
            log.warning(
                "bf16 prompt products of a %s layer depend on the other rows of their block: "
                "greedy output may depend on the batch (TANDEM_INFERENCE_PROMPT_DTYPE=float32 avoids it)",
                tuple(weight.shape),
            )
        return packed, block or PROMPT_BLOCK

    def apply(self, input: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        flat = input.reshape(-1, input.shape[-1])
        out = self.product(self.rows(flat), prepared)[: flat.shape[0]].to(input.dtype)
        out = out.view(*input.shape[:-1], -1)
        return out if bias is None else out + bias

    def rows(self, input: torch.Tensor) -> torch.Tensor:
        """``[n, in]`` rows in bf16 with zero rows up to a whole number of ``PROMPT_BLOCK``s (one
        cast and copy)."""
        count = input.shape[0]
        padded = -(-count // PROMPT_BLOCK) * PROMPT_BLOCK
        if padded == count:
            return input.to(COMPUTE_DTYPE)
        rows = input.new_empty(padded, input.shape[1], dtype=COMPUTE_DTYPE)
        rows[:count] = input
        rows[count:] = 0
        return rows

    def product(self, rows: torch.Tensor, prepared: Any) -> torch.Tensor:
        """The bf16 product of ``rows`` (``self.rows``), block by block: ``[padded, out]``."""
        packed, block = prepared
        blocks = [
            torch.ops.mkldnn._linear_pointwise(rows[start : start + block], packed, None, "none", [], "")
            for start in range(0, rows.shape[0], block)
        ]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _block_rows(packed: torch.Tensor, in_features: int) -> int:
    """The largest block (``PROMPT_BLOCK`` rows, or a multiple up to ``PROMPT_BLOCK_MAX``) in which
    a row's bf16 product has the bits it has in any block of ``PROMPT_BLOCK`` rows, whatever rows
    are beside it and at whatever place; 0 when even blocks of ``PROMPT_BLOCK`` rows do not give
    a row its own bits (different arithmetic matching bit for bit on random rows would be a
    coincidence)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(PROMPT_BLOCK_MAX + PROMPT_BLOCK, in_features, generator=gen).to(COMPUTE_DTYPE)

    def product(block: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(block, packed, None, "none", [], "")

    # every row in 64-row blocks; then rows shifted by half a block (other neighbours, other places)
    reference = torch.cat(
        [product(rows[s : s + PROMPT_BLOCK]) for s in range(0, rows.shape[0], PROMPT_BLOCK)]
    )
    shift = PROMPT_BLOCK // 2
    if not torch.equal(product(rows[shift : shift + PROMPT_BLOCK]), reference[shift : shift + PROMPT_BLOCK]):
        return 0
    best = PROMPT_BLOCK
    for size in range(2 * PROMPT_BLOCK, PROMPT_BLOCK_MAX + 1, PROMPT_BLOCK):
        if not torch.equal(product(rows[shift : shift + size]), reference[shift : shift + size]):
            break
        best = size
    return best


class TwoSides:
    """A layer's weight prepared for prompt tokens and for decode tokens, each side when first
    asked (``ByTokenKind.decode_side`` / ``prompt_side``): where a lean forward multiplies one kind
    of token with weights of its own (``fused_decode.py``, ``fused_prompt.py``), this layer's copy
    for that kind is never made."""

    __slots__ = ("decode", "prompt", "weight")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # the layer's own weight (an alias, not a copy)
        self.prompt: Any = None
        self.decode: Any = None


class ByTokenKind:
    """One kernel for decode tokens, another for prompt tokens, in the same layer. A decode step
    multiplies a few rows, where reading quantised weights wins; a prompt chunk many rows, where
    the weight-only kernels are about 2x slower than oneDNN's (64 rows: int4 271 ms vs bf16 124,
    fp32 239 for a step's products, measured as in the module doc). Choosing by the kind of
    token, never by the size of the batch, keeps each token's numbers the same whatever else
    shares its forward (greedy output alone = in a batch): every kernel computes each row on
    its own."""

    def __init__(self, decode: LinearKernel, prompt: LinearKernel) -> None:
        self.decode = decode
        self.prompt = prompt

    def prepare(self, weight: torch.Tensor) -> TwoSides:
        return TwoSides(weight)

    def decode_side(self, prepared: TwoSides) -> Any:
        """The weight prepared for decode tokens (made on the first call)."""
        return _side(prepared, "decode", self.decode)

    def prompt_side(self, prepared: TwoSides) -> Any:
        """The weight prepared for prompt tokens (made on the first call)."""
        return _side(prepared, "prompt", self.prompt)

    def apply(self, input: torch.Tensor, prepared: TwoSides, bias: torch.Tensor | None) -> torch.Tensor:
        decode = ragged.decode_token_count()
        rows = input.shape[0]
        if decode is None or decode >= rows:
            return self.decode.apply(input, self.decode_side(prepared), bias)
        if decode == 0:
            return self.prompt.apply(input, self.prompt_side(prepared), bias)
        return torch.cat(
            [
                self.decode.apply(input[:decode], self.decode_side(prepared), bias),
                self.prompt.apply(input[decode:], self.prompt_side(prepared), bias),
            ]
        )


def _side(prepared: TwoSides, kind: str, kernel: LinearKernel) -> Any:
    """``prepared``'s side ``kind`` (decode or prompt), prepared by ``kernel`` when first asked."""
    side = getattr(prepared, kind)
    if side is None:
        with torch.no_grad():
            side = kernel.prepare(prepared.weight)
        setattr(prepared, kind, side)
    return side


def int4_round_trip_error(weight: torch.Tensor) -> float:
    """Relative error of ``weight`` quantised as ``Int4WeightOnly`` does (in fp32, before the
    kernel's bf16 scales)."""
    q, scale, low = q4_1_groups(weight)
    groups = weight.detach().float().reshape(q.shape)
    back = q * scale[..., None] + low[..., None]
    return float((back - groups).norm() / groups.norm().clamp(min=1e-12))


def q8_round_trip_error(weight: torch.Tensor) -> float:
    """Relative error of ``weight`` in Q8_0 blocks (``Q8Rows``: a scale of max|w| / 127 a block of
    32; 0 for a Q8_0 file's values, whose largest in a block is 127 times its fp16 scale)."""
    w = weight.detach().float()
    if w.shape[1] % Q8_BLOCK:
        return float("inf")
    blocks = w.view(w.shape[0], -1, Q8_BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    back = torch.round(blocks / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127) * scale
    return float((back - blocks).norm() / blocks.norm().clamp(min=1e-12))


def resolve(
    mode: Quantize,
    model: torch.nn.Module,
    output_head: torch.nn.Module | None,
    device: torch.device,
    *,
    q8_rows: bool = False,
) -> Quantize:
    """``auto``: int4 on a CPU when every layer int4 would quantise holds 4-bit values already
    (a model de-quantised from a Q4_0/Q4_1 GGUF, such as the default one), so quantising loses
    nothing; int8 where ``q8_rows`` (the CPU multiplies Q8_0 blocks times int8 rows) and every
    layer holds Q8_0 values (a Q8_0 GGUF's); otherwise none (an fp32/bf16 checkpoint or a full
    fine-tune keeps its own numbers; ask for int4 or int8 explicitly). Other modes are returned as
    they are."""
    if mode != "auto":
        return mode
    if device.type != "cpu" or available("int4", device) is not None:
        return "none"
    layers = [
        m
        for name, m in model.named_modules()
        if type(m) is torch.nn.Linear
        and ".lora_" not in f".{name}"
        and m is not output_head
        and m.in_features % INT4_GROUP == 0
    ]
    with torch.no_grad():
        if bool(layers) and all(int4_round_trip_error(m.weight) <= LOSSLESS_INT4 for m in layers):
            return "int4"
        if q8_rows and bool(layers) and all(q8_round_trip_error(m.weight) <= LOSSLESS_INT4 for m in layers):
            return "int8"
    return "none"


def available(mode: Quantize, device: torch.device) -> str | None:
    """Why ``mode`` cannot run on ``device`` in this torch build (None: it can)."""
    if mode in ("none", "auto"):
        return None
    if device.type != "cpu":
        return f"weight-only {mode} is a CPU kernel; the model runs on {device.type}"
    kernel: Int8WeightOnly | Int4WeightOnly = Int8WeightOnly() if mode == "int8" else Int4WeightOnly()
    try:
        weight = torch.ones(32, 2 * INT4_GROUP)
        out = kernel.apply(torch.ones(1, 2 * INT4_GROUP), kernel.prepare(weight), None)
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return f"this torch build has no CPU weight-only {mode} kernel ({exc})"
    if not torch.allclose(out, torch.full((1, 32), 2.0 * INT4_GROUP), rtol=1e-2):
        return f"this torch build's CPU weight-only {mode} kernel gives wrong results"
    return None


def resolve_prompt_dtype(
    setting: PromptDType,
    quantize: Quantize,
    model_dtype: torch.dtype,
    cpu: CpuFeatures | None = None,
    *,
    blocks: bool = False,
) -> PromptDType:
    """The dtype prompt tokens multiply in. ``auto`` for an fp32 model whose decode tokens run
    quantised (int4/int8; ``cpu``: the CPU's features, None for this machine's):

    - ``int8`` where the decode products are the own blocks times int8 rows (``blocks``:
      ``Int4Blocks`` or ``Q8Rows``) and oneDNN cannot use AMX: prompt rows take the decode
      weights, quantised to int8 in groups of 32 as decode rows are. On a Xeon's AVX512-VNNI
      without AMX a layer's products at 256 rows took 16 ms this way against 43 ms in bf16 (oneDNN
      on AVX512-BF16) and, on AVX2 alone, 36 ms against 37 ms in fp32; no second copy of the
      weights is prepared for prompts, and prompt and decode tokens share one kernel's numbers;
    - ``bfloat16`` where the CPU has native bf16 products (AMX: 7 ms against the int8 rows' 17);
      the prompt's keys/values and first token then carry bf16 rounding, as the decode tokens'
      products do already (benchmarks/RESULTS.md, "Prompt tokens in bf16");
    - else the model's own (``float32`` keeps the prompt the fp32 model's).

    An explicit ``bfloat16`` is honoured whatever the quantisation (emulated, and slow, on a CPU
    without native bf16); an explicit ``int8`` needs the block kernels (``plan.resolve_plan``
    refuses it otherwise).

    The bf16 products run in blocks of a fixed row count (``BlockedBF16``): oneDNN's bf16 result
    for a row moves with the row count on some CPUs (an AMX Xeon's greedy SmolLM2 tokens differed
    alone and in a batch of 16 with one product over all prompt rows), not at a fixed one."""
    if model_dtype != torch.float32:
        return "auto"  # a bf16/fp16 model's prompt products are in its own dtype already
    if setting != "auto":
        return setting
    features = cpu if cpu is not None else cpu_features()
    if quantize not in ("int4", "int8"):
        return "float32"
    if blocks and not features.amx_usable:
        return "int8"
    return "bfloat16" if features.native_bf16 else "float32"


def prompt_kernel(prompt_dtype: PromptDType, batch_hint: int = 16) -> LinearKernel:
    """The kernel prompt tokens multiply with where they do not take the decode kernel (``int8``:
    ``layer_kernels``): oneDNN-packed in the model's dtype, or in bf16 in blocks of
    ``PROMPT_BLOCK`` rows (``BlockedBF16``: each row's result independent of the batch, a
    one-token chunk's lone row included)."""
    return BlockedBF16(batch_hint) if prompt_dtype == "bfloat16" else OneDNNPacked(batch_hint)


def layer_kernels(
    mode: Quantize,
    output_head: torch.nn.Module | None,
    batch_hint: int = 16,
    prompt_dtype: PromptDType = "float32",
    *,
    q8_head: Q8Head = None,
    int4_blocks: bool = False,
    int8_blocks: bool = False,
) -> KernelChoice:
    """The kernel of each base linear layer under ``mode``. Prompt tokens in the decoder layers
    (``prompt_dtype``, resolved by ``resolve_prompt_dtype``): with the decode blocks themselves
    (``int8``: the layer's one kernel, where its decode kernel is ``Int4Blocks`` or ``Q8Rows``),
    or with the model's own weights oneDNN-packed, in bf16 or the model's dtype (torch's int4/int8
    kernels are slower than oneDNN's at a prompt's many rows). The output head's prompt rows (a
    prompt's last token: its first generated token's logits) stay in the model's dtype: at 1 row
    per prompt they cost little, and a bf16 head moved SmolLM2's first-token logits most of all
    the layers (benchmarks/RESULTS.md). Decode tokens: int8 in every layer; or int4 in every layer
    whose input size is a multiple of the group, the output head (and any other layer) in bf16,
    oneDNN-packed (in the model's dtype where oneDNN has no bf16: an AVX2-only CPU). The head
    alone at 1 / 16 rows (SmolLM2's 49K x 576): 6.5 / 10 ms in bf16, 5.9 / 23 ms in int8 (its kernel scales badly with rows), 12 / 22 ms in fp32."""
    own = OneDNNPacked(batch_hint)
    prompt = prompt_kernel(prompt_dtype, batch_hint)
    int8, bf16 = Int8WeightOnly(), BF16Packed(batch_hint)
    # the own Q4_1 x int8 kernel where the plan says so (the module built), each layer whose outputs
    # are whole tiles; torch's int4 kernel elsewhere
    int4, q4, q8 = Int4WeightOnly(), Int4Blocks(), Q8Rows()
    # oneDNN packs bf16 weights only where the CPU has bf16 instructions (AVX512-BF16, AMX,
    # AVX-NE-CONVERT, or AVX512BW/VL/DQ): an AVX2-only CPU's head keeps the model's dtype
    other = bf16 if mode == "int4" and packed_linear.available(torch.device("cpu"), COMPUTE_DTYPE) else own
    # the head's decode rows in Q8_0 blocks where the plan says so (plan.resolve_plan)
    head_decode: LinearKernel = other
    if mode == "int4" and q8_head is not None:
        head_decode = Q8Rows() if q8_head == "q8_0-int8" else Q8Blocks()

    def by_kind(decode: LinearKernel, prompt_side: LinearKernel) -> LinearKernel:
        # int8 prompt rows: the decode blocks for every token of the layer (one prepared weight)
        if prompt_dtype == "int8" and prompt_side is not own and type(decode) in (Int4Blocks, Q8Rows):
            return decode
        return ByTokenKind(decode, prompt_side)

    def choose(_name: str, module: torch.nn.Linear) -> LinearKernel | None:
        head = module is output_head
        prompt_side = own if head else prompt
        if mode in ("none", "auto"):
            # quantisation off: decode tokens in the model's dtype; prompt tokens in bf16 if asked
            return own if prompt_side is own else ByTokenKind(own, prompt_side)
        if mode == "int8":
            # Q8_0 blocks times int8 rows where the plan says so (AVX512-VNNI, the module built),
            # for every layer whose outputs are whole tiles and the head; torch's per-channel int8 elsewhere
            blocks = int8_blocks and module.in_features % Q8_BLOCK == 0
            return by_kind(
                q8 if blocks and (head or module.out_features % Q4_TILE == 0) else int8, prompt_side
            )
        if not head and module.in_features % INT4_GROUP == 0:
            return by_kind(q4 if int4_blocks and module.out_features % Q4_TILE == 0 else int4, prompt_side)
        if head and module.in_features % Q8_BLOCK == 0:
            return ByTokenKind(head_decode, prompt_side)
        return ByTokenKind(other, prompt_side)

    return choose
