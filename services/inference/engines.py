"""Builds the engine the settings ask for (torch, vllm, remote or llamacpp) and full models registered later."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.config import CommonSettings
from services.inference.config import InferenceSettings
from services.inference.engine.base import Engine
from services.inference.engine.loader import DEFAULT_MODEL_NAME, resolve_model

if TYPE_CHECKING:
    from services.inference.engine.quantized_linear import Quantize


def cache_root(common: CommonSettings) -> Path:
    return common.home_dir / "models" / "cache"


def served_name(settings: InferenceSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    if not settings.model or settings.model == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_NAME
    path = Path(settings.model)
    return path.stem if path.suffix == ".gguf" else path.name


def _dtype(settings: InferenceSettings, common: CommonSettings) -> Any:
    import torch

    from services.common.platforms import current_platform

    if settings.dtype == "auto":
        return current_platform(common.device).default_dtype()
    return getattr(torch, settings.dtype)


def quantize_mode(settings: InferenceSettings, device: Any) -> Quantize:
    """The weight quantisation the torch engine is asked for on ``device``; a mode that cannot
    run there stops start-up naming the setting (``auto`` is resolved by the engine, which sees
    the weights: ``quantized_linear.resolve``)."""
    from services.inference.engine import quantized_linear

    problem = quantized_linear.available(settings.quantize, device)
    if problem is not None:
        raise ValueError(f"TANDEM_INFERENCE_QUANTIZE={settings.quantize}: {problem}")
    return settings.quantize


def check_architecture(path: Path, model: str | None) -> None:
    """Stops start-up, in one line, when no engine here can serve the model folder's
    architecture (its ``config.json``'s ``model_type``), naming it and what can serve what.
    An architecture transformers has a causal LM for is served: by the lean forward for the
    families it covers, else by the Hugging Face forward, which the forward plan names."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from services.inference.engine.layer_ops import FAMILIES

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"TANDEM_INFERENCE_MODEL={model or path}: {path / 'config.json'} is unreadable: {exc}"
        ) from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    what = f"architecture {model_type!r}" if model_type else "a config.json without a model_type"
    raise ValueError(
        f"TANDEM_INFERENCE_MODEL={model or path}: {what} cannot be served: "
        f"TANDEM_INFERENCE_ENGINE=torch serves {', '.join(FAMILIES)} on its lean forward and the other "
        f"causal LMs of transformers {_transformers_version()} on the Hugging Face forward "
        f"(e.g. {', '.join(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)[:5])}, ...); "
        "TANDEM_INFERENCE_ENGINE=llamacpp serves the GGUF files of llama.cpp's architectures; "
        "TANDEM_INFERENCE_ENGINE=vllm (GPU images) serves vLLM's"
    )


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def scheduler_settings(settings: InferenceSettings) -> dict[str, Any]:
    """The scheduler's settings, alike for every engine that runs it (torch, llamacpp)."""
    return {
        "max_batch_size": settings.max_batch_size,
        "max_queue": settings.max_queue,
        "tenant_max_queued": settings.tenant_max_queued,
        "prefill_chunk": settings.prefill_chunk,
        "admit_window": settings.admit_window_ms / 1000,
        "max_model_len": settings.max_model_len,
        "request_timeout": settings.request_timeout,
        "stall_after": settings.stall_s,
    }


def build_torch_engine(
    settings: InferenceSettings,
    common: CommonSettings,
    name: str,
    model: str | None,
    tokenizer_fallback: Path | None = None,
) -> Engine:
    import torch

    from services.common.platforms import current_platform
    from services.inference.engine.prompt_lookup import PromptLookup
    from services.inference.engine.torch_engine import TorchEngine

    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device(current_platform(common.device).device())
    quantize = quantize_mode(settings, device)
    path = resolve_model(model or None, cache_root(common))
    check_architecture(path, model)
    return TorchEngine.from_pretrained(
        path,
        name=name,
        device=device,
        dtype=_dtype(settings, common),
        prefix_cache_mb=settings.prefix_cache_mb,
        tokenizer_fallback=tokenizer_fallback,
        num_threads=settings.threads,
        quantize=quantize,
        prompt_dtype=settings.prompt_dtype,
        forward=settings.forward,
        native_decode=settings.native_decode,
        kv_dtype=settings.kv_dtype,
        prompt_lookup=settings.prompt_lookup,
        prompt_lookup_sizes=PromptLookup(
            settings.prompt_lookup_tokens, settings.prompt_lookup_min, settings.prompt_lookup_max
        ),
        **scheduler_settings(settings),
    )


async def build_engine(settings: InferenceSettings, common: CommonSettings) -> Engine:
    name = served_name(settings)
    if settings.engine == "remote":
        from services.inference.engine.remote import RemoteEngine

        if not settings.remote_url:
            raise ValueError("TANDEM_INFERENCE_ENGINE=remote needs TANDEM_INFERENCE_REMOTE_URL")
        return RemoteEngine(
            settings.remote_url,
            api_key=settings.remote_api_key,
            timeout=settings.request_timeout,
            structured_outputs=settings.remote_structured_outputs,
        )
    if settings.engine == "vllm":
        from services.inference.engine.vllm_engine import VLLMEngine

        path = await asyncio.to_thread(resolve_model, settings.model or None, cache_root(common))
        return VLLMEngine(
            str(path),
            name=name,
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_batch_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            dtype=settings.dtype,
            max_lora_rank=settings.max_lora_rank or 64,
            max_loras=min(settings.max_adapters, 64) if settings.max_adapters else 8,
        )
    if settings.engine == "llamacpp":
        return await asyncio.to_thread(build_llamacpp_engine, settings, common, name)
    from services.inference.engine.scheduler_engine import in_own_thread

    # a thread that ends: see in_own_thread (the scheduler thread's forwards)
    return await in_own_thread(build_torch_engine, settings, common, name, settings.model)


def build_llamacpp_engine(settings: InferenceSettings, common: CommonSettings, name: str) -> Engine:
    """The llama.cpp engine on the GGUF file itself (no de-quantising): the default model's
    file, or ``TANDEM_INFERENCE_MODEL`` when it names a .gguf file."""
    from services.inference.engine.llamacpp_engine import LlamaCppEngine, check_gguf, import_llama_cpp
    from services.inference.engine.loader import default_gguf_path

    if not settings.model or settings.model == DEFAULT_MODEL_NAME:
        path = default_gguf_path()
    else:
        path = Path(settings.model).expanduser()
        if path.suffix != ".gguf":
            raise ValueError(
                f"TANDEM_INFERENCE_ENGINE=llamacpp serves GGUF files; TANDEM_INFERENCE_MODEL={settings.model!r} "
                "is not a .gguf file"
            )
    check_gguf(path)
    import_llama_cpp()  # a missing module stops start-up with how to install it
    return LlamaCppEngine(
        path,
        name=name,
        threads=settings.threads,
        cache_root=cache_root(common),
        requantize=settings.llamacpp_requantize,
        **scheduler_settings(settings),
    )


def torch_builder(settings: InferenceSettings, common: CommonSettings) -> Any:
    async def build(name: str, path: Path) -> Engine:
        # a registered fine-tune without tokenizer files borrows the served base model's
        base = await asyncio.to_thread(resolve_model, settings.model or None, cache_root(common))
        from services.inference.engine.scheduler_engine import in_own_thread

        return await in_own_thread(build_torch_engine, settings, common, name, str(path), base)

    return build
