"""Index versions of an embedded collection: which embedder its dense vectors come from.

A collection's chunks carry the vectors of its *active* version (``chunks.embedding``); the
vectors of the version being built by a reindex job, and of the previous version kept for a
rollback, wait in the store's ``staged`` table. Which version is which is three rows of the
store's ``meta`` table (``index_active``, ``index_previous``, ``index_building``), so a switch
(move the active vectors to ``staged``, the target's into ``chunks``, flip the rows) is one
SQLite transaction: a crash leaves either version whole, never a mix, and every process
notices the flip through SQLite's ``data_version`` as it notices another process's writes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from services.common.errors import Conflict, TandemError

ACTIVE, PREVIOUS, BUILDING = "index_active", "index_previous", "index_building"


@dataclass(frozen=True)
class IndexVersion:
    """One index version: its number (1 is the collection as created), the embedder's name as
    the client gave it, where that model was found, its dimension, and the reindex job that
    built it (empty for version 1)."""

    version: int
    embedder: str
    model_path: str
    dim: int
    job_id: str = ""
    created_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> IndexVersion:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class IndexState:
    active: IndexVersion
    previous: IndexVersion | None = None
    building: IndexVersion | None = None

    def top(self) -> int:
        """The highest version number known (a new build takes the next one)."""
        return max(v.version for v in (self.active, self.previous, self.building) if v is not None)


class IndexVersionChanged(Exception):
    """A write embedded with one version's embedder found another version active at commit;
    nothing was written, and the writer re-embeds with the new embedder."""


class VersionSuperseded(Exception):
    """Vectors were staged for a version that is no longer being built (a newer reindex
    replaced it, or it was switched to already)."""


class NotSupported(TandemError):
    status_code = 501
    type = "not_supported_error"


def check_dim(embedder: str, got: int, expected: int, holder: str) -> None:
    """409 when ``embedder`` gives vectors of another size than ``holder`` expects."""
    if got != expected:
        raise Conflict(
            f"embedder {embedder!r} gives {got}-dimensional vectors, but {holder} "
            f"expects {expected}-dimensional ones",
            param="embedder",
            code="embedding_dimension_mismatch",
        )
