"""Evaluation sets and runs: a tenant's questions with their expected answers, answered through a
pipeline, judged (``judge``), kept in Redis (``store``), run, compared and checked for regressions
(``runs``). The routes are services/agent/api/evals.py."""
