"""The default model written as GGUF files of the quantisation types people download, for
``decode_nll --model`` (what the int4 decode kernels lose against each file's own values).

The weights are the default model's (its Q4_1 file de-quantised), quantised again to each type
with the ``gguf`` package's writer in llama.cpp's mixes (``tests/helpers/gguf_files.py``). SmolLM2's
hidden size, 576, is not whole 256-value super-blocks, so as in llama.cpp's own Q4_K_M / Q5_K_M
files of it every tensor but ``ffn_down`` falls back to Q5_0 / Q5_1 (and Q6_K to Q8_0).

    python -m benchmarks.inference.gguf_types /tmp/smol-types Q4_0 Q4_K_M Q8_0
    python -m benchmarks.inference.decode_nll --model /tmp/smol-types/SmolLM2-Q4_K_M.gguf --kinds fp32,int4-q8

``--shape qwen3-0.6b`` writes a random-initialised model of Qwen3-0.6B's configuration instead
(28 layers, hidden 1024, 16 query and 8 key/value heads of 128, q/k norms; the default model's
tokenizer and vocabulary, as no Qwen tokenizer is at hand offline), for ``benchmarks.inference
--model`` against llama.cpp on the same file:

    python -m benchmarks.inference.gguf_types /tmp/q3 Q4_K_M --shape qwen3-0.6b
    python -m benchmarks.inference --model /tmp/q3/Qwen3-0.6B-shape-Q4_K_M.gguf --engines llamacpp-raw,torch
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any


def main() -> int:
    from tests.helpers.gguf_files import MIXES, write_llama_gguf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("types", nargs="+", choices=sorted(MIXES))
    ap.add_argument("--shape", choices=["smollm2", "qwen3-0.6b"], default="smollm2")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import smollm2_dir

    if args.shape == "qwen3-0.6b":
        model, stem = qwen3_shape(), "Qwen3-0.6B-shape"
    else:
        model, stem = (
            AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval(),
            "SmolLM2",
        )
    args.folder.mkdir(parents=True, exist_ok=True)
    for mix in args.types:
        path = args.folder / f"{stem}-{mix}.gguf"
        types = write_llama_gguf(model, path, mix)
        print(path, dict(Counter(types.values())), flush=True)
    return 0


def qwen3_shape() -> Any:
    """A random-initialised model of Qwen3-0.6B's configuration, with the default model's vocabulary."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3Config(
        vocab_size=49152,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = tf.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # weights of a trained model's scale: greedy text is not one token repeated
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model


if __name__ == "__main__":
    raise SystemExit(main())
