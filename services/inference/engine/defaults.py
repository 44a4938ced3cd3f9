"""The serving defaults: one source for the engines' constructors and the server's settings.

An engine made in code with no arguments runs as the server runs with no settings, so a
benchmark or test that builds one measures the engine that is served. The server's settings
(``services/inference/config.py``) take their defaults from here; the engine library imports
nothing of the server, so the values live on this side. Plain values only: the server's
settings import this module without torch.
"""

from __future__ import annotations

from typing import Final

# the scheduler's (torch and llama.cpp engines alike)
MAX_BATCH_SIZE: Final = 16
MAX_QUEUE: Final = 64
TENANT_MAX_QUEUED: Final = 16
PREFILL_CHUNK: Final = 256
ADMIT_WINDOW_MS: Final = 20.0
MAX_MODEL_LEN: Final = 2048
REQUEST_TIMEOUT_S: Final = 300.0
# readiness fails once requests have waited this long for the engine loop to finish a step
STALL_S: Final = 10.0
THREADS: Final = 0

# the torch engine's
PREFIX_CACHE_MB: Final = 64.0
FORWARD: Final = "auto"
QUANTIZE: Final = "auto"
PROMPT_DTYPE: Final = "auto"
NATIVE_DECODE: Final = "auto"
KV_DTYPE: Final = "model"
# prompt-lookup decoding (prompt_lookup.py): draft tokens a step, n-gram sizes looked up
PROMPT_LOOKUP: Final = "auto"
PROMPT_LOOKUP_TOKENS: Final = 4
PROMPT_LOOKUP_MIN: Final = 4
PROMPT_LOOKUP_MAX: Final = 6

# the llama.cpp engine's
LLAMACPP_REQUANTIZE: Final = "none"
