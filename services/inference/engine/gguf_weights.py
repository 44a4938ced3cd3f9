"""A GGUF file's quantised weights as the engine's int4 kernels hold them.

The loader de-quantises a GGUF once into an fp32 safetensors folder (``loader.convert_gguf``);
that keeps every value of the file. The int4 decode kernels (``quantized_linear.Int4Blocks``,
``Int4WeightOnly``) hold a layer as 4-bit values in groups of ``INT4_GROUP`` = 32 inputs with a
scale and a minimum each, ``w = q * scale + low``. Three GGUF types are exactly that shape:

    type   block                                       scale        low
    Q4_0   32 values, fp16 d, w = d * (q - 8)           d            -8 * d
    Q4_1   32 values, fp16 d and m, w = d * q + m       d            m
    Q4_K   256 values in 8 sub-blocks of 32, fp16 d     d * sc       -(dmin * m)
           and dmin, 6-bit sc and m per sub-block

(each product of an fp16 value and a 6-bit integer is exact in fp32, and so is ``q * scale +
low``: the kernel's groups give the file's de-quantised values back bit for bit). Re-deriving
the groups from the de-quantised weights (each group's minimum and maximum) finds them only where
a group spans all 16 levels, as Q4_1's quantiser leaves it; Q4_0's and Q4_K's groups often do not
(Q4_0's reach level 0 but rarely 15; a Q4_K sub-block's minimum is clamped at 0 and its levels are
rounded to 6-bit scales), so the file's own scales and minima are kept here.

How they reach the kernels: ``register`` reads the file's 4-bit tensors once (when the loader
resolves the file) and files each row's groups under a fingerprint of the row's de-quantised
fp32 values. A kernel preparing a weight (``quantized_linear.q4_1_groups``) looks its rows up
(``file_groups``): a row found, whose values ``q * scale + low`` give back bit for bit, takes the
file's groups; any other row is quantised from its own minimum and maximum, as before. Looking up
by value, not by name, finds the rows wherever the engine puts them: in a layer's own weight, in
q/k/v or gate/up weights side by side (the lean forwards' products), after transformers reorders
q/k rows for its RoPE layout; and a weight the trainer changed in place no longer matches, so it
is quantised from its new values.

The other types are kept de-quantised (fp32, the file's values exactly); under int4 (asked for,
or ``auto`` on a file whose layers are 4-bit) their layers are quantised from their values like
any fp32 weight (Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 rows lose precision: the loss is measured with
``benchmarks.inference.decode_nll``, ``benchmarks/RESULTS.md``). A type outside ``SUPPORTED`` is
refused before anything is converted (``UnsupportedGGUFType``, naming it).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tandem.engine.gguf_weights")

# the int4 kernels' group (quantized_linear.INT4_GROUP, which imports this module lazily)
GROUP = 32
# types whose blocks the int4 kernels hold exactly
INT4_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q4_K")
# every tensor type the loader takes: float types, the int4 ones, and the 5/6/8-bit types of the
# files people download (Q5_K_M and Q4_K_M mix in Q6_K, and Q5_0/Q5_1/Q8_0 where a row is not
# whole 256-value super-blocks), de-quantised
SUPPORTED: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", *INT4_TYPES, "Q5_K", "Q6_K")
# files registered at once (one engine a process, a trainer's rollout engine beside it)
MAX_FILES = 4


class UnsupportedGGUFType(ValueError):
    """A GGUF tensor type the engine does not load (the message names it and the types it does)."""


def _unsupported(path: Path, tensor: str, type_name: str) -> UnsupportedGGUFType:
    return UnsupportedGGUFType(
        f"{path.name}: tensor {tensor!r} is of GGUF type {type_name}, which this engine does not "
        f"load; supported types: {', '.join(SUPPORTED)}"
    )


def _fp16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes ``[..., 16]`` -> 4-bit values ``[..., 32]``: the low nibbles, then the high ones
    (GGUF's order within a block of 32)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def int4_groups(type_name: str, raw: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 / Q4_K tensor's raw bytes as the int4 kernels' groups: ``q`` uint8 ``[rows,
    columns]`` (0..15), ``scale`` and ``low`` fp32 ``[rows, columns / 32]``, ``w = q * scale + low``
    equal to the file's de-quantised values."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, type_size)
    rows = blocks.shape[0] * block_size // columns
    if type_name == "Q4_0":
        d = _fp16(blocks[:, 0:2])
        q, scale, low = _nibbles(blocks[:, 2:]), d, -8 * d
    elif type_name == "Q4_1":
        d, m = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
        q, scale, low = _nibbles(blocks[:, 4:]), d, m
    elif type_name == "Q4_K":
        d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scale = d * sc.astype(np.float32)  # [n, 8]
        low = -(dmin * m.astype(np.float32))
        # 4 chunks of 32 bytes: the low nibbles are sub-block 2c, the high ones 2c + 1
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8 * 32)
    else:
        raise ValueError(f"{type_name} blocks are not 4-bit groups of {GROUP}")
    groups = columns // GROUP
    return (
        q.reshape(rows, columns),
        np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, groups),
        np.ascontiguousarray(low, dtype=np.float32).reshape(rows, groups),
    )


def values(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``q * scale + low`` per group, in fp32 as two roundings (a product, then a sum: never a
    fused multiply-add), which is how GGUF's de-quantisation computes them. ``q`` ``[rows,
    columns]``, ``scale``/``low`` ``[rows, columns / 32]``."""
    rows, columns = q.shape
    grouped = q.float().view(rows, columns // GROUP, GROUP)
    product = grouped * scale[..., None]
    return (product + low[..., None]).view(rows, columns)


# a row's fingerprint: the fp32 bits of ``SAMPLED`` values spread along the row, as two 16-bit
# halves weighted by random 20-bit integers and summed in int64 (exact, whatever the summation
# order); the halves' sums are combined with a wrapping multiply. A lookup is checked against all
# of the row's values, so two rows sharing a fingerprint cost a lost match, never a wrong value.
SAMPLED = 64


def _columns(columns: int) -> torch.Tensor:
    return torch.linspace(0, columns - 1, min(columns, SAMPLED)).round().long().unique()


def _coefficients(count: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(count)
    return torch.randint(1, 1 << 20, (2, count), generator=gen, dtype=torch.int64)


def fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """One int64 per row of the fp32 ``rows`` ``[n, columns]``, a function of the row's bits."""
    return _fingerprint_picked(rows.detach().float()[:, _columns(rows.shape[1])])


def _fingerprint_picked(picked: torch.Tensor) -> torch.Tensor:
    # + 0.0 makes -0.0 +0.0: Q4_0's d * (q - 8) is -0.0 where d < 0, the kernels' q * d - 8 * d +0.0
    picked = (picked + 0.0).contiguous()
    coef = _coefficients(picked.shape[1])
    bits = picked.view(torch.int32).to(torch.int64)
    low = (bits & 0xFFFF) @ coef[0]
    high = ((bits >> 16) & 0xFFFF) @ coef[1]
    return low * 1_000_003 + high


@dataclass
class _Table:
    """The rows of one width: sorted fingerprints and each row's scales and minima."""

    keys: torch.Tensor  # int64 [rows], sorted
    scale: torch.Tensor  # fp32 [rows, groups]
    low: torch.Tensor


@dataclass
class FileGroups:
    """One file's 4-bit rows, by width (input features)."""

    path: Path
    tables: dict[int, _Table]
    types: Counter[str]


_files: dict[str, FileGroups] = {}
_lock = threading.Lock()


def _file_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def read_groups(path: Path) -> FileGroups:
    """The int4 groups of every Q4_0 / Q4_1 / Q4_K tensor of ``path`` whose rows are whole groups."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    types: Counter[str] = Counter()
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name not in SUPPORTED:
            raise _unsupported(path, tensor.name, name)
        types[name] += 1
        columns = int(tensor.shape[0])  # GGUF's first dimension is a row's length
        if name not in INT4_TYPES or len(tensor.shape) != 2 or columns % GROUP:
            continue
        q_np, scale_np, low_np = int4_groups(name, np.asarray(tensor.data), columns)
        scale, low = torch.from_numpy(scale_np), torch.from_numpy(low_np)
        # the fingerprinted values only (the sampled columns), computed as ``values`` does
        picked = _columns(columns)
        sampled = (
            torch.from_numpy(q_np)[:, picked].float() * scale[:, picked // GROUP] + low[:, picked // GROUP]
        )
        keys = _fingerprint_picked(sampled)
        parts.setdefault(columns, []).append((keys, scale, low))
    tables = {}
    for columns, chunks in parts.items():
        keys = torch.cat([c[0] for c in chunks])
        order = torch.argsort(keys)
        tables[columns] = _Table(
            keys[order], torch.cat([c[1] for c in chunks])[order], torch.cat([c[2] for c in chunks])[order]
        )
    return FileGroups(path, tables, types)


# the groups of a converted file, saved beside its weights (a cached start reads no GGUF), in
# safetensors' format under a name no weight loader globs for (``*.safetensors``, ``*.bin``)
GROUPS_FILE = "gguf-int4-groups.st"


def save_groups(groups: FileGroups, folder: Path) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for columns, table in groups.tables.items():
        tensors[f"keys.{columns}"] = table.keys
        tensors[f"scale.{columns}"] = table.scale
        tensors[f"low.{columns}"] = table.low
    save_file(tensors, str(folder / GROUPS_FILE), metadata={"types": json.dumps(dict(groups.types))})


def load_groups(path: Path, folder: Path) -> FileGroups | None:
    """The groups saved in ``folder`` for the GGUF ``path`` (None: none saved)."""
    from safetensors import safe_open

    saved = folder / GROUPS_FILE
    if not saved.is_file():
        return None
    with safe_open(str(saved), framework="pt") as handle:
        types = Counter(json.loads((handle.metadata() or {}).get("types", "{}")))
        widths = sorted({int(k.split(".")[1]) for k in handle.keys()})  # noqa: SIM118 (a safe_open handle is not a dict)
        tables = {
            w: _Table(
                handle.get_tensor(f"keys.{w}"), handle.get_tensor(f"scale.{w}"), handle.get_tensor(f"low.{w}")
            )
            for w in widths
        }
    return FileGroups(path, tables, types)


def register(path: Path, groups: FileGroups) -> None:
    """Make ``path``'s groups the int4 kernels' for the rows that hold its values; log what each
    tensor type becomes."""
    with _lock:
        _files[_file_key(path)] = groups
        while len(_files) > MAX_FILES:
            _files.pop(next(iter(_files)))
    log.info("GGUF %s: %s", path.name, describe(groups.types))


def forget(path: Path | None = None) -> None:
    """Drop one registered file (None: all of them)."""
    with _lock:
        if path is None:
            _files.clear()
        else:
            _files.pop(_file_key(path), None)


def describe(types: Counter[str]) -> str:
    """What each of a file's tensor types becomes in the engine (one line: logged, and what a plan
    says of a GGUF's weights)."""
    counts = ", ".join(f"{n} {name}" for name, n in sorted(types.items()))
    kept = sorted(t for t in types if t in INT4_TYPES)
    other = sorted(t for t in types if t not in INT4_TYPES and t not in ("F32", "F16", "BF16"))
    parts = [f"tensors {counts}"]
    if kept:
        parts.append(f"{'/'.join(kept)} layers: the file's 4-bit groups kept in the int4 kernels")
    if other:
        parts.append(
            f"{'/'.join(other)} tensors: de-quantised to fp32 (the int4 kernels cannot hold them); "
            "their decoder layers re-quantised to int4 groups where int4 decode is on"
        )
    return "; ".join(parts)


def file_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The registered files' groups of ``weight``'s rows ``[out, in]``: ``q`` (fp32, 0..15),
    ``scale``, ``low`` (as ``quantized_linear.q4_1_groups`` gives them) and ``found`` (bool
    ``[out]``: rows whose groups are the file's, giving the row's values back bit for bit; the
    other rows' entries are meaningless). None: no registered file has rows of this width."""
    out_f, in_f = weight.shape
    with _lock:
        tables = [f.tables[in_f] for f in _files.values() if in_f in f.tables]
    if not tables:
        return None
    w = weight.detach().float()
    keys = fingerprints(w)
    groups = in_f // GROUP
    scale = torch.ones(out_f, groups)
    low = torch.zeros(out_f, groups)
    found = torch.zeros(out_f, dtype=torch.bool)
    for table in tables:
        at = torch.searchsorted(table.keys, keys).clamp(max=table.keys.numel() - 1)
        hit = (table.keys[at] == keys) & ~found
        scale[hit], low[hit] = table.scale[at[hit]], table.low[at[hit]]
        found |= hit
    if not bool(found.any()):
        return None
    grouped = w.view(out_f, groups, GROUP)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round((grouped - low[..., None]) / safe[..., None]).clamp(0, 15)
    q = torch.where((scale == 0)[..., None], torch.zeros_like(q), q)
    back = values(q.view(out_f, in_f), scale, low)
    found &= (back == w).all(dim=1)
    return q, scale, low, found
