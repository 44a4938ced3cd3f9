"""One job vocabulary for every service that runs jobs (retrieval ingestion, trainer fine-tunes).

A job's state is in ``status`` and is one of these names everywhere, so a client (the CLI's
docs bootstrap, the web UI) reads any service's job the same way.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JOB_STATUSES: Final[tuple[JobStatus, ...]] = get_args(JobStatus)
# A job in one of these never changes again.
TERMINAL: Final[tuple[JobStatus, ...]] = ("succeeded", "failed", "cancelled")


def is_terminal(status: str) -> bool:
    return status in TERMINAL
