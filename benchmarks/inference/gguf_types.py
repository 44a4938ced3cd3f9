"""The default model written as GGUF files of the quantisation types people download, for
``decode_nll --model`` (what the int4 decode kernels lose against each file's own values).

The weights are the default model's (its Q4_1 file de-quantised), quantised again to each type
with the ``gguf`` package's writer in llama.cpp's mixes (``tests/helpers/gguf_files.py``). SmolLM2's
hidden size, 576, is not whole 256-value super-blocks, so as in llama.cpp's own Q4_K_M / Q5_K_M
files of it every tensor but ``ffn_down`` falls back to Q5_0 / Q5_1 (and Q6_K to Q8_0).

    python -m benchmarks.inference.gguf_types /tmp/smol-types Q4_0 Q4_K_M Q8_0
    python -m benchmarks.inference.decode_nll --model /tmp/smol-types/SmolLM2-Q4_K_M.gguf --kinds fp32,int4-q8
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def main() -> int:
    from tests.helpers.gguf_files import MIXES, write_llama_gguf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("types", nargs="+", choices=sorted(MIXES))
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import smollm2_dir

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    args.folder.mkdir(parents=True, exist_ok=True)
    for mix in args.types:
        path = args.folder / f"SmolLM2-{mix}.gguf"
        types = write_llama_gguf(model, path, mix)
        print(path, dict(Counter(types.values())), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
