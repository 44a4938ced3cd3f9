"""Publishing a finished job to the inference service, so it can be chatted with at once.

An adapter goes to ``POST {inference}/v1/load_lora_adapter {"lora_name", "lora_path"}``;
a full model to ``POST {inference}/v1/models/register {"name", "path"}`` (a Tandem
extension). Both with ``TANDEM_SERVICE_API_KEY``. The artifact folder lies under
``$TANDEM_HOME/models``, inside the inference service's default model roots.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from services.common.config import CommonSettings
from services.trainer.protocol import JobCreate


class PublishError(RuntimeError):
    pass


def published_name(job_id: str) -> str:
    return f"ft-{job_id.removeprefix('ftjob-')}"


def publish(common: CommonSettings, job_id: str, spec: JobCreate, path: Path, timeout: float = 120.0) -> str:
    if not common.service_api_key:
        raise PublishError("publish needs TANDEM_SERVICE_API_KEY (a key the inference service accepts)")
    name = published_name(job_id)
    base = common.url_of("inference")
    if spec.lora is not None:
        url, body = f"{base}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
    else:
        url, body = f"{base}/v1/models/register", {"name": name, "path": str(path)}
    headers = {"Authorization": f"Bearer {common.service_api_key}"}
    try:
        resp = httpx.post(url, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise PublishError(f"inference service at {base} unreachable: {exc}") from None
    if resp.status_code >= 400:
        raise PublishError(f"inference service refused {url}: {resp.status_code} {resp.text[:300]}")
    return name
