"""Training recipes (torchtune-style): SFT, DPO, PPO, GRPO over shared components."""
