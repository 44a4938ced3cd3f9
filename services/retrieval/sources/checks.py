"""What a new source must be before it is stored: each problem a 400 naming the field and value.

The same checks run again at every sync (an operator may change the roots or the private-address
setting, a host may move), where they fail the sync instead.
"""

from __future__ import annotations

import uuid

from services.common.errors import InvalidRequest
from services.common.outbound import RefusedAddress, Resolver, system_resolver
from services.retrieval.config import RetrievalSettings
from services.retrieval.protocol import CreateSource
from services.retrieval.sources.folder import folder_path
from services.retrieval.sources.git import check_branch, check_remote, local_repo
from services.retrieval.sources.globs import translate
from services.retrieval.sources.store import Source
from services.retrieval.sources.web import check_start_url


def new_source_id() -> str:
    return f"src_{uuid.uuid4().hex[:12]}"


def _refused(url: str, exc: RefusedAddress) -> InvalidRequest:
    return InvalidRequest(
        f"url {url!r}: {exc} (an operator may allow private addresses: TANDEM_RETRIEVAL_SOURCE_ALLOW_PRIVATE)",
        param="url",
        code="address_refused",
    )


async def new_source(
    body: CreateSource, settings: RetrievalSettings, now: float, resolver: Resolver = system_resolver
) -> Source:
    """The source ``body`` asks for, checked; its first sync is due at once (``now``)."""
    for i, pattern in enumerate(body.paths):
        translate(pattern, f"paths.{i}")
    minimum = settings.source_min_interval_minutes
    if 0 < body.interval_minutes < minimum:
        raise InvalidRequest(
            f"interval_minutes {body.interval_minutes}: at least {minimum} "
            "(TANDEM_RETRIEVAL_SOURCE_MIN_INTERVAL_MINUTES), or 0 to sync only on demand",
            param="interval_minutes",
        )
    if body.branch is not None and body.type != "git":
        raise InvalidRequest(
            f"branch: only a git source has one (this is a {body.type} source)", param="branch"
        )
    roots = settings.source_root_paths()
    url = body.url.strip()
    try:
        if body.type == "git":
            if body.branch is not None:
                check_branch(body.branch)
            await check_remote(url, roots, settings.source_allow_private, resolver)
            if url.lower().startswith("file:") and not local_repo(url, roots).is_dir():
                raise InvalidRequest(f"url {url!r}: no such repository folder on the server", param="url")
        elif body.type == "web":
            url = await check_start_url(url, settings.source_allow_private, resolver)
        else:
            if not folder_path(url, roots).is_dir():
                raise InvalidRequest(f"url {url!r}: no such folder on the server", param="url")
    except RefusedAddress as exc:
        raise _refused(url, exc) from None
    except (ValueError, OSError) as exc:  # a URL urllib cannot split, a path no file system can hold
        raise InvalidRequest(f"url {url!r}: unusable ({exc})", param="url", code="bad_url") from None
    return Source(
        id=new_source_id(),
        type=body.type,
        url=url,
        branch=body.branch,
        paths=list(body.paths),
        interval_minutes=body.interval_minutes,
        created_at=now,
        next_sync_at=now if body.interval_minutes else None,
    )
