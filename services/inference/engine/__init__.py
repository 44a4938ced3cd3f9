"""The generation engine as a library: scheduler, KV cache, model loading, sampling.

It imports nothing else of the inference service (no FastAPI, no routes, no
server settings), so the trainer can run it in process for PPO/GRPO rollouts.
"""

from services.inference.engine.types import (
    EngineRequest,
    GenerationOutput,
    SamplingParams,
    StreamEvent,
)

__all__ = ["EngineRequest", "GenerationOutput", "SamplingParams", "StreamEvent", "TorchEngine"]


def __getattr__(name: str) -> object:
    # TorchEngine pulls in torch and transformers: import it only when asked for
    if name == "TorchEngine":
        from services.inference.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(name)
