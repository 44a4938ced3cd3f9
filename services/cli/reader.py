"""``tandem reader``: the answer reader, a cross-encoder that scores whether a sentence of a
document answers a question.

``tandem reader dataset [--docs DIR] [--out FILE] [--seed N]`` builds its training rows from the
FAQs of four Debian documentation packages unpacked under ``DIR`` (default
``$TANDEM_ANSWER_DOCS``, else ``~/.cache/tandem/answer-docs``; ``python -m
benchmarks.answers.fetch`` puts them there): JSONL to ``FILE`` (gzip when it ends in ``.gz``) or
stdout, and a one-line summary to stderr. The rules live with the trainer, which owns its data
formats (``services/trainer/data/faq.py``); the command runs that module as a child process,
as the stack runs the trainer's workers, so the CLI imports no service code.

``tandem reader train [--dataset FILE] [--name tandem-reader] [--wait]`` trains a reader through
the trainer's API (a ``reader`` job, shared with every tenant, so an operator key: the stack's
``service-key``): by default on the dataset shipped in ``services/trainer/reader_data/``,
published as ``tandem-reader``; ``TANDEM_AGENT_READER=tandem-reader`` makes it the answer step's
reader for every tenant.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import typer

# the trainer's dataset builder, run as ``python -m``
DATASET_MODULE = "services.trainer.data.faq"
# the shipped training rows (built by ``tandem reader dataset``) and the default reader's name
SHIPPED_DATASET = Path(__file__).resolve().parents[1] / "trainer" / "reader_data" / "faq.jsonl.gz"
DEFAULT_READER = "tandem-reader"

reader_app = typer.Typer(help="The answer reader: its training data and its training.", no_args_is_help=True)


class ReaderJobError(RuntimeError):
    pass


@dataclass(frozen=True)
class ReaderJob:
    id: str
    name: str


def _rows(dataset: Path) -> bytes:
    data = dataset.read_bytes()
    return gzip.decompress(data) if dataset.suffix == ".gz" else data


def start_reader_job(
    trainer_url: str,
    operator_key: str,
    *,
    dataset: Path = SHIPPED_DATASET,
    name: str = DEFAULT_READER,
    transport: httpx.BaseTransport | None = None,
) -> ReaderJob:
    """Uploads ``dataset`` and starts a shared reader job published as ``name``; ReaderJobError
    with the trainer's message when a call fails."""
    with httpx.Client(
        base_url=trainer_url.rstrip("/"),
        headers={"Authorization": f"Bearer {operator_key}"},
        timeout=120.0,
        transport=transport,
    ) as client:
        files = {"file": (dataset.name.removesuffix(".gz"), _rows(dataset), "application/jsonl")}
        up = client.post("/v1/files", files=files, data={"purpose": "fine-tune"})
        if up.status_code >= 400:
            raise ReaderJobError(f"uploading {dataset}: HTTP {up.status_code}: {up.text[:300]}")
        body = {"type": "reader", "dataset": up.json()["id"], "shared": True, "name": name}
        job = client.post("/v1/jobs", json=body)
        if job.status_code >= 400:
            raise ReaderJobError(f"starting the reader job: HTTP {job.status_code}: {job.text[:300]}")
        return ReaderJob(job.json()["id"], name)


def _home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or ".tandem")


def dataset_args(docs: Path | None, out: Path | None, seed: int) -> list[str]:
    """The builder's command line."""
    args = [sys.executable, "-m", DATASET_MODULE, "--seed", str(seed)]
    if docs is not None:
        args += ["--docs", str(docs)]
    if out is not None:
        args += ["--out", str(out)]
    return args


@reader_app.command("dataset")
def dataset_command(
    docs: Path | None = typer.Option(
        None,
        "--docs",
        help="Folder of the unpacked packages (default $TANDEM_ANSWER_DOCS or ~/.cache/tandem/answer-docs).",
    ),
    out: Path | None = typer.Option(
        None, "--out", help="JSONL file to write (gzip when it ends in .gz); default stdout."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the random choices (a build is deterministic)."),
) -> None:
    """Build the reader's training rows from the FAQs of Debian documentation packages."""
    done = subprocess.run(dataset_args(docs, out, seed), capture_output=True, check=False)
    # relayed through typer so that whoever captures this command's streams gets them
    if done.stdout:
        typer.echo(done.stdout.decode(), nl=False)
    if done.stderr:
        typer.echo(done.stderr.decode(), nl=False, err=True)
    if done.returncode:
        raise typer.Exit(done.returncode)


@reader_app.command("train")
def train_command(
    dataset: Path = typer.Option(SHIPPED_DATASET, "--dataset", help="Reader rows (JSONL, or .jsonl.gz)."),
    name: str = typer.Option(DEFAULT_READER, "--name", help="Name the reader is published under."),
    trainer_url: str | None = typer.Option(None, "--trainer-url", help="Default: the running stack's."),
    key_file: Path | None = typer.Option(
        None, "--key-file", help="Operator key (default $TANDEM_HOME/service-key)."
    ),
    wait: bool = typer.Option(False, "--wait", help="Wait until the job ends, printing its progress."),
) -> None:
    """Train the answer reader on ``--dataset`` and publish it for every tenant as ``--name``."""
    home = _home()
    url = trainer_url or _stack_url(home, "trainer")
    key = (key_file or home / "service-key").read_text().strip()
    try:
        job = start_reader_job(url, key, dataset=dataset, name=name)
    except (ReaderJobError, httpx.HTTPError, OSError) as exc:
        typer.echo(f"reader job not started: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"reader job {job.id}: publishes {job.name} when it ends")
    if wait:
        _follow(url, key, job.id)


def _stack_url(home: Path, service: str) -> str:
    import json

    try:
        return str(json.loads((home / "run" / "stack.json").read_text())["urls"][service])
    except (OSError, ValueError, KeyError):
        typer.echo(f"no running stack in {home}: start one with `tandem up`, or give --trainer-url", err=True)
        raise typer.Exit(1) from None


def _follow(url: str, key: str, job_id: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    while True:
        job = httpx.get(f"{url.rstrip('/')}/v1/jobs/{job_id}", headers=headers, timeout=30.0).json()
        progress = job.get("progress") or {}
        typer.echo(f"{job['status']}: step {progress.get('step', 0)} of {progress.get('total', 0)}")
        if job["status"] in ("succeeded", "failed", "cancelled"):
            if job["status"] != "succeeded":
                typer.echo(f"reader job {job_id} {job['status']}: {job.get('error')}", err=True)
                raise typer.Exit(1)
            return
        time.sleep(10.0)


__all__ = [
    "ReaderJob",
    "ReaderJobError",
    "dataset_command",
    "reader_app",
    "start_reader_job",
    "train_command",
]
