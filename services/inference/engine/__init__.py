"""The generation engine as a library: scheduler, KV cache, model loading, sampling.

It imports nothing else of the inference service (no FastAPI, no routes, no
server settings), so the trainer can run it in process for PPO/GRPO rollouts.
"""
