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
    # 3 epochs: on feedback of thumbs down and corrections (85 pairs, benchmarks.loop --user
    # strict) 2 epochs took the model-written [n] 8% -> 32%, 3 to 95% with the facts kept (53%),
    # 4 to 100% with facts lost (47%)
    "dpo": {
        "lora": {"learning_rate": 2e-4, "n_epochs": 3, "beta": 0.1},
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
        # desirable_weight / undesirable_weight: balanced to the dataset's counts (losses.kto_weights)
        "lora": {"learning_rate": 2e-4, "n_epochs": 2, "beta": 0.1},
        "full": {"learning_rate": 5e-6, "n_epochs": 1, "beta": 0.1},
    },
    "ppo": {"lora": {"learning_rate": 1e-4}, "full": {"learning_rate": 1e-5}},
    "grpo": {"lora": {"learning_rate": 1e-4}, "full": {"learning_rate": 1e-5}},
    # sentence-transformers' usual MNRL fine-tune: the batch is the pool of in-batch negatives;
    # a job that names its collection gets COLLECTION_EMBEDDER below instead
    "embedder": {"full": {"learning_rate": 2e-5, "n_epochs": 1, "batch_size": 32, "warmup_steps": 10}},
    # a cross-encoder's usual fine-tune (sentence-transformers' CrossEncoder examples: lr 2e-5 to
    # 5e-5 with a short warmup), sized for 2 CPU cores: one pass over the rows, 160 tokens being
    # a question with one sentence under its heading path; not yet measured on a benchmark
    # a features reader (recipes/reader_features.py): a logistic regression over 35
    # standardised numbers; 20 passes in batches of 1024 (about 150 steps on the question sets'
    # tuning rows) train in about a second
    "reader-features": {
        "full": {
            "learning_rate": 0.02,
            "n_epochs": 20,
            "batch_size": 1024,
            "weight_decay": 1e-3,
            "warmup_steps": 0,
        }
    },
    # a bi-encoder reader (recipes/reader_bi.py): one question and its candidates a step, two
    # passes at sentence-transformers' usual fine-tuning rate, 128 tokens (a question's heading
    # path and sentence): benchmarks/RESULTS.md, "the answer step on thirteen document sets"
    "reader-bi": {
        "full": {
            "learning_rate": 2e-5,
            "n_epochs": 2,
            "batch_size": 1,
            "warmup_steps": 10,
            "max_seq_length": 128,
        }
    },
    "reader": {
        "full": {
            "learning_rate": 4e-5,
            "n_epochs": 1,
            "batch_size": 32,
            "warmup_steps": 10,
            "max_seq_length": 160,
        }
    },
}


# Embedder jobs that name their collection: the recipe measured best on held-out queries. Each
# choice with the SciFact runs that made it (held-out dense / hybrid nDCG@10, 140 queries; the
# base all-MiniLM-L6-v2 0.6693 / 0.7136; `benchmarks/RESULTS.md` "fine-tuned embedders" holds the
# winning run, git history the others):
# - stages "titles_first": the title and heading pairs of 2,000 documents for one epoch, then the
#   labelled pairs: 0.7066 / 0.7427; the labelled pairs alone (as chunks) 0.6691 / 0.7387; the
#   titles alone 0.6720 / 0.7175.
# - positives "chunks": each labelled pair on its document's chunk nearest the query, as the
#   collection indexes it: 0.6960 / 0.7430 against 0.6846 / 0.7378 on whole documents (staged).
# - 3 hard negatives from the collection's own hybrid ranks 5-50 at lr 8e-5: 0.6837 / 0.7324 on
#   the labelled pairs alone, against 0.6821 / 0.7318 with 2 at lr 5e-5.
# - 4 epochs of the labelled stage: 8 gave 0.6837 / 0.7381 against 4's 0.6960 / 0.7430.
# - batch 32 with warmup 5, MNRL: cached MNRL gave the same figures (0.7038 / 0.7460) in 1.8x the time.
# Through the API with these defaults and "apply" (benchmarks/RESULTS.md, "retriever tuning with
# defaults"): SciFact dense 0.6675 -> 0.6902, hybrid 0.7105 -> 0.7353 on queries the job never
# saw, 28.5 minutes with the reindex; the job holds out 0.1 of its pairs (protocol.APPLY_HELD_OUT).
# Plain pairs (no collection) keep TYPE_DEFAULTS["embedder"]: on a 1,000-document SciFact sample
# lr 2e-5 gave nDCG@10 0.8102 (2 epochs) against 0.8071 at lr 1e-4 (3 epochs).
COLLECTION_EMBEDDER: dict[str, Any] = {
    "learning_rate": 8e-5,
    "n_epochs": 4,
    "batch_size": 32,
    "warmup_steps": 5,
    "hard_negatives": 3,
    "hard_negatives_from": "collection",
    "hard_negatives_skip": 5,
    "title_epochs": 1,
    "title_documents": 2000,
}


def defaults_for(job_type: str, *, lora: bool, collection: bool = False) -> dict[str, Any]:
    if job_type == "embedder" and collection:
        return dict(COLLECTION_EMBEDDER)
    return dict(TYPE_DEFAULTS.get(job_type, {}).get("lora" if lora else "full", {}))
