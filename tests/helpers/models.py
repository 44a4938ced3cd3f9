"""Models for tests: the real SmolLM2-135M (converted once, cached across runs) and
tiny random-initialised models of the same architecture with its tokenizer."""

from __future__ import annotations

from pathlib import Path

from services.inference.engine.loader import resolve_model

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = REPO_ROOT / ".cache" / "models"


def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a safetensors folder (about 20 s the first time)."""
    return resolve_model(None, MODEL_CACHE)


def make_tiny_llama(
    target: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, seed: int = 0
) -> Path:
    """A 2-layer Llama (SmolLM2's architecture) with random weights and SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (target / "config.json").is_file():
        return target
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target
