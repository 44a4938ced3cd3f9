"""Models for tests: the real SmolLM2-135M (converted once, cached across runs) and
tiny random-initialised models of the same architecture with its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.inference.engine.loader import resolve_model

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_CACHE = REPO_ROOT / ".cache" / "models"


def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a safetensors folder (about 20 s the first time)."""
    return resolve_model(None, MODEL_CACHE)


def small_decoder(
    vocab_size: int,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 2048,
) -> dict[str, int]:
    """The size arguments of a small decoder config (Llama, Qwen2, Mistral name them alike)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
    }


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
        **small_decoder(len(tokenizer), hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads),
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


def make_lora_adapter(
    base: Path,
    target: Path,
    seed: int,
    *,
    r: int = 8,
    modules: list[str] | None = None,
    b_std: float = 0.3,
) -> Path:
    """A PEFT LoRA adapter for ``base`` whose B matrices are random (not zero, standard deviation
    ``b_std``), so it changes the model's output: adapters made with different seeds answer
    differently."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=16,
        target_modules=modules or ["q_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, b_std)
    peft_model.save_pretrained(target)
    return target


def greedy_reference(base: Path, adapter: Path | None, prompt: str, n: int) -> str:
    """What transformers' greedy ``generate`` answers to ``prompt`` (``n`` tokens exactly), with
    the adapter applied when one is given: the reference the engines must equal."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
