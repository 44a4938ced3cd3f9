"""Per-job-type defaults: the one place to tune what a request without hyperparameters gets.

``JobCreate`` fills every hyperparameter the request left out from here (the stored
request then shows the values that ran). The "train on feedback" button starts a LoRA
job with no hyperparameters at all, so the LoRA rows are what a user gets by default:
they are chosen to move a small model (SmolLM2-135M, a few hundred rows) in minutes on a
CPU. Preference losses give small gradients at ``beta`` around 0.1 (a sigmoid's slope
times beta), so their LoRA learning rate is higher than SFT's and they run two epochs.
"""

from __future__ import annotations

from typing import Any

# type -> {"lora": {...}, "full": {...}} hyperparameter defaults (anything in Hyperparameters)
TYPE_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "sft": {"lora": {"learning_rate": 1e-4, "n_epochs": 1}, "full": {"learning_rate": 1e-5, "n_epochs": 1}},
    "dpo": {
        "lora": {"learning_rate": 2e-4, "n_epochs": 2, "beta": 0.1},
        "full": {"learning_rate": 5e-6, "n_epochs": 1, "beta": 0.1},
    },
    # SimPO's rewards are length-normalised (per-token) log-probs, so beta is larger (paper: 2-2.5)
    "simpo": {
        "lora": {"learning_rate": 2e-4, "n_epochs": 2, "beta": 2.0, "simpo_gamma": 0.5},
        "full": {"learning_rate": 5e-6, "n_epochs": 1, "beta": 2.0, "simpo_gamma": 0.5},
    },
    # ORPO: beta is the weight lambda of the odds-ratio term next to the chosen answer's NLL
    "orpo": {
        "lora": {"learning_rate": 2e-4, "n_epochs": 2, "beta": 0.1},
        "full": {"learning_rate": 5e-6, "n_epochs": 1, "beta": 0.1},
    },
    "kto": {
        "lora": {
            "learning_rate": 2e-4,
            "n_epochs": 2,
            "beta": 0.1,
            "desirable_weight": 1.0,
            "undesirable_weight": 1.0,
        },
        "full": {"learning_rate": 5e-6, "n_epochs": 1, "beta": 0.1},
    },
    "ppo": {"lora": {"learning_rate": 1e-4}, "full": {"learning_rate": 1e-5}},
    "grpo": {"lora": {"learning_rate": 1e-4}, "full": {"learning_rate": 1e-5}},
    # sentence-transformers' usual MNRL fine-tune: the batch is the pool of in-batch negatives
    "embedder": {"full": {"learning_rate": 2e-5, "n_epochs": 1, "batch_size": 32, "warmup_steps": 10}},
}


def defaults_for(job_type: str, *, lora: bool) -> dict[str, Any]:
    return dict(TYPE_DEFAULTS.get(job_type, {}).get("lora" if lora else "full", {}))
