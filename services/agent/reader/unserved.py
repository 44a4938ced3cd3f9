"""Readers the inference service said it does not serve, remembered for a while.

The default reader (``tandem-reader``) is published by a training job that ``make up`` starts,
and a compose or Kubernetes stack serves none until ``tandem reader train`` has run: until then
every answer's ``/v1/rerank`` call is a 404 and the features scorer answers. Remembering the 404
for ``hold_s`` lets the answer step go straight to the features scorer (no call, one warning a
minute instead of one an answer), and a reader published meanwhile is asked again once the hold
ends. Kept per caller's key: a tenant's own reader is found by its key only.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

HOLD_S = 60.0  # how long a 404 stands: a reader published meanwhile answers after at most this
LIMIT = 1024  # (caller, reader) pairs kept; the oldest go first


class UnservedReaders:
    def __init__(
        self, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic, limit: int = LIMIT
    ) -> None:
        self.hold_s = hold_s
        self.clock = clock
        self.limit = limit
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()

    @staticmethod
    def _key(api_key: str, model: str) -> tuple[str, str]:
        # a digest, not the key itself: the table outlives the request that held it
        return hashlib.sha256(api_key.encode()).hexdigest()[:32], model

    def holds(self, api_key: str, model: str) -> bool:
        """Whether ``model`` was a 404 for this key less than ``hold_s`` ago."""
        key = self._key(api_key, model)
        until = self._until.get(key)
        if until is None:
            return False
        if self.clock() >= until:
            del self._until[key]
            return False
        return True

    def mark(self, api_key: str, model: str) -> None:
        key = self._key(api_key, model)
        self._until.pop(key, None)
        self._until[key] = self.clock() + self.hold_s
        while len(self._until) > self.limit:
            self._until.popitem(last=False)
