"""ONNX exports of a sentence-transformers model, made here from its local folder and cached.

Why not sentence-transformers' ``backend="onnx"``: it loads through optimum's
``ORTModelForFeatureExtraction``, and the only optimum-onnx release (0.1.0) needs
transformers < 4.58 (importing it under the pinned transformers 5.x fails on
``transformers.modeling_utils.get_parameter_dtype``). So the export is torch's own
``torch.onnx.export`` (the dynamo exporter: the TorchScript one traces transformers 5's
attention-mask code with the example's shapes and gives wrong vectors for other paddings), and
int8 is ONNX Runtime's ``quantize_dynamic``, the function optimum's ``ORTQuantizer`` calls.

The whole sentence-transformers pipeline is exported (transformer, pooling, normalisation), so a
forward pass is one ``InferenceSession.run`` and no torch op runs per batch.

Cache: ``<cache_root>/<key>/`` where the key hashes the model folder (its path, and the names,
sizes and modification times of its files) and ``EXPORT_VERSION``; it holds ``model.onnx``,
``model_int8.onnx`` (made from it on first use) and ``export.json``. Each file is written under a
temporary name and renamed into place, so a crash leaves either no file or a whole one, and a
folder with a file is reused by every later process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.common.atomic import atomic_write, fsync_path

log = logging.getLogger("tandem.retrieval")

EmbeddingBackend = Literal["torch", "onnx", "onnx-int8"]
EMBEDDING_BACKENDS: tuple[EmbeddingBackend, ...] = ("torch", "onnx", "onnx-int8")
# Bump when the export or quantisation changes, so old cached files are not reused.
EXPORT_VERSION = 1
OPSET = 18

_lock = threading.Lock()


@dataclass(frozen=True)
class QuantConfig:
    """``quantize_dynamic`` options: int8 weights, activations quantised per batch at run time.

    Measured on MiniLM (64 SciFact documents, cosine to the fp32 export): per-tensor weights
    0.935 mean / 0.900 min; per-channel 0.994 / 0.991; per-channel with the feed-forward output
    projections (the matmuls after GELU, whose inputs have outliers) left in fp32 0.997 / 0.996,
    at a cost in speed. Hence per-channel by default."""

    per_channel: bool = True
    reduce_range: bool = False
    # Leave the feed-forward down-projections (the MatMuls reading GELU outputs) in fp32.
    fp32_ffn_output: bool = False

    @property
    def suffix(self) -> str:
        flags = ("-pc", self.per_channel), ("-rr", self.reduce_range), ("-ffn32", self.fp32_ffn_output)
        return "int8" + "".join(f for f, on in flags if on)


def _ffn_output_nodes(fp32: Path) -> list[str]:
    """MatMuls whose weight is [intermediate, hidden] with intermediate > hidden: the
    feed-forward down-projections of a BERT-like encoder."""
    import onnx

    graph = onnx.load(str(fp32), load_external_data=False).graph
    shapes = {i.name: tuple(i.dims) for i in graph.initializer}
    out = []
    for node in graph.node:
        dims = [shapes[x] for x in node.input if x in shapes]
        if node.op_type == "MatMul" and dims and len(dims[0]) == 2 and dims[0][0] > dims[0][1]:
            out.append(node.name)
    return out


def onnx_missing() -> str | None:
    """Why the ONNX backend cannot run here (a missing package), or None when it can."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def cache_key(model_path: Path) -> str:
    """Changes when the model folder's files change (a re-published fine-tune at the same path)."""
    h = hashlib.sha256(f"v{EXPORT_VERSION}:{model_path.resolve()}".encode())
    for f in sorted(p for p in model_path.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"\n{f.relative_to(model_path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def export_dir(model_path: Path, cache_root: Path) -> Path:
    return cache_root / cache_key(model_path)


def _export_fp32(st_model: Any, target: Path) -> None:
    import torch

    prepare = getattr(st_model, "preprocess", None) or st_model.tokenize
    example = prepare(["an example sentence to export", "short"])
    # Tensors are the graph's inputs; anything else (sentence-transformers 6 adds "modality")
    # is a constant of the export.
    names = [k for k, v in example.items() if isinstance(v, torch.Tensor)]
    constants = {k: v for k, v in example.items() if k not in names}

    class Pipeline(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.st = st_model

        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            features = {**constants, **dict(zip(names, tensors, strict=True))}
            out: torch.Tensor = self.st(features)["sentence_embedding"]
            return out

    args = tuple(example[n] for n in names)
    dyn = torch.export.Dim.DYNAMIC
    # One entry: forward's *tensors, a tuple with batch and sequence dynamic in each.
    shapes = (tuple({0: dyn, 1: dyn} for _ in names),)
    with torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(
            Pipeline().eval(),
            args,
            str(target),
            input_names=names,
            output_names=["sentence_embedding"],
            dynamic_shapes=shapes,
            opset_version=OPSET,
            dynamo=True,
            external_data=False,
            verbose=False,
        )


# Counts exports made by this process (tests check that a cached export is reused).
exports_made = 0


def _write_whole(target: Path, make: Any) -> None:
    """``make(tmp_path)`` writes a file; it appears at ``target`` whole or not at all."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        make(tmp)
        fsync_path(tmp)
        os.replace(tmp, target)
        fsync_path(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_export(
    st_model: Any, model_path: Path, cache_root: Path, quant: QuantConfig | None = None
) -> Path:
    """The ``.onnx`` file of this model (int8 with ``quant``), exported on first use."""
    global exports_made
    folder = export_dir(model_path, cache_root)
    fp32 = folder / "model.onnx"
    target = fp32 if quant is None else folder / f"model_{quant.suffix}.onnx"
    with _lock:
        if target.exists():
            return target
        folder.mkdir(parents=True, exist_ok=True)
        if not fp32.exists():
            t0 = time.perf_counter()
            _write_whole(fp32, lambda tmp: _export_fp32(st_model, tmp))
            exports_made += 1
            log.info("exported %s to ONNX in %.1f s: %s", model_path, time.perf_counter() - t0, fp32)
        if quant is not None:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            t0 = time.perf_counter()
            _write_whole(
                target,
                lambda tmp: quantize_dynamic(
                    fp32,
                    tmp,
                    weight_type=QuantType.QInt8,
                    per_channel=quant.per_channel,
                    reduce_range=quant.reduce_range,
                    nodes_to_exclude=_ffn_output_nodes(fp32) if quant.fp32_ffn_output else None,
                ),
            )
            exports_made += 1
            log.info("quantised %s to int8 in %.1f s: %s", fp32, time.perf_counter() - t0, target)
        info = {
            "model_path": str(model_path),
            "export_version": EXPORT_VERSION,
            "opset": OPSET,
            "files": sorted(p.name for p in folder.glob("model*.onnx")),
        }
        atomic_write(folder / "export.json", json.dumps(info, indent=2).encode())
    return target
