"""A deterministic embedder for tests of the answer step: hashed word counts, so the cosine of
two texts is the share of words they have in common (no model to load)."""

from __future__ import annotations

import zlib

import numpy as np

DIM = 256


async def bag_of_words(texts: list[str]) -> list[list[float]]:
    """One vector per text: its lower-cased words (``.`` and ``?`` aside) counted into ``DIM``
    buckets by their CRC-32."""
    out = []
    for text in texts:
        v = np.zeros(DIM, dtype=np.float32)
        for w in text.lower().replace(".", " ").replace("?", " ").split():
            v[zlib.crc32(w.encode()) % DIM] += 1.0
        out.append(v.tolist())
    return out
