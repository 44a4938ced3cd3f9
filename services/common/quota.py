"""Per-tenant storage quotas: an upload that would pass the quota is a 507 with the numbers."""

from __future__ import annotations

import os
from pathlib import Path

from services.common.errors import InsufficientStorage

MIB = 1024 * 1024


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist). Runs in a thread: it walks a tree."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed while we walked
                continue
    return total


def check_quota(tenant: str, used: int, adding: int, quota_mb: int, setting: str) -> None:
    """Refuse ``adding`` bytes when ``used + adding`` passes ``quota_mb`` (0: no quota)."""
    if quota_mb <= 0:
        return
    quota = quota_mb * MIB
    if used + adding > quota:
        raise InsufficientStorage(
            f"tenant {tenant!r} uses {used / MIB:.1f} MiB of its {quota_mb} MiB storage quota; "
            f"this upload of {adding / MIB:.1f} MiB would pass it (set by {setting})",
            param="file",
            code="quota_exceeded",
        )
