"""``tandem reader``: the answer reader, a cross-encoder that scores whether a sentence of a
document answers a question.

``tandem reader dataset [--docs DIR] [--out FILE] [--seed N]`` builds its training rows from the
FAQs of four Debian documentation packages unpacked under ``DIR`` (default
``$TANDEM_ANSWER_DOCS``, else ``~/.cache/tandem/answer-docs``; ``python -m
benchmarks.answers.fetch`` puts them there): JSONL to ``FILE`` (gzip when it ends in ``.gz``) or
stdout, and a one-line summary to stderr. The rules live with the trainer, which owns its data
formats (``services/trainer/data/faq.py``); the command runs that module as a child process,
as the stack runs the trainer's workers, so the CLI imports no service code.

``tandem reader train [--dataset FILE] [--kind bi-encoder|cross-encoder] [--name tandem-reader]
[--if-missing] [--wait]`` trains a reader through the trainer's API (a ``reader`` job, shared
with every tenant, so an operator key: the stack's ``service-key``): by default a bi-encoder on
the tuning question sets' candidate sentences shipped in ``services/trainer/reader_data/``
(``tuning.jsonl.gz``), reported on the shipped FAQ rows (``faq.jsonl.gz``, ``--eval-dataset``),
published as ``tandem-reader``, the agent's default reader (``TANDEM_AGENT_READER``). ``make up``
runs it with ``--if-missing``: a stack trains its reader once, in the background.
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
# the shipped training rows: the FAQs' (built by ``tandem reader dataset``) and the tuning question
# sets' candidates (``python -m benchmarks.answers.reader_eval dataset``), what the default reader
# trains on; and the default reader's name and kind
READER_DATA = Path(__file__).resolve().parents[1] / "trainer" / "reader_data"
FAQ_DATASET = READER_DATA / "faq.jsonl.gz"
SHIPPED_DATASET = READER_DATA / "tuning.jsonl.gz"
DEFAULT_READER = "tandem-reader"
DEFAULT_KIND = "bi-encoder"
KINDS = ("bi-encoder", "cross-encoder")

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
    eval_dataset: Path | None = FAQ_DATASET,
    name: str = DEFAULT_READER,
    kind: str = DEFAULT_KIND,
    transport: httpx.BaseTransport | None = None,
) -> ReaderJob:
    """Uploads ``dataset`` (and ``eval_dataset``, the held-out rows; None: the trainer holds out a
    fifth of ``dataset``'s groups) and starts a shared reader job of ``kind`` published as
    ``name``; ReaderJobError with the trainer's message when a call fails."""
    with httpx.Client(
        base_url=trainer_url.rstrip("/"),
        headers={"Authorization": f"Bearer {operator_key}"},
        timeout=120.0,
        transport=transport,
    ) as client:

        def upload(path: Path) -> str:
            files = {"file": (path.name.removesuffix(".gz"), _rows(path), "application/jsonl")}
            up = client.post("/v1/files", files=files, data={"purpose": "fine-tune"})
            if up.status_code >= 400:
                raise ReaderJobError(f"uploading {path}: HTTP {up.status_code}: {up.text[:300]}")
            return str(up.json()["id"])

        body = {
            "type": "reader",
            "dataset": upload(dataset),
            "shared": True,
            "name": name,
            "reader_kind": kind,
        }
        if eval_dataset is not None:
            body["eval_dataset"] = upload(eval_dataset)
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
    eval_dataset: Path | None = typer.Option(
        FAQ_DATASET,
        "--eval-dataset",
        help="Held-out rows the job reports on (default: the shipped FAQ rows, another kind of "
        "document than the training rows).",
    ),
    no_eval_dataset: bool = typer.Option(
        False, "--no-eval-dataset", help="Hold out a fifth of --dataset's groups instead."
    ),
    if_missing: bool = typer.Option(
        False, "--if-missing", help="Do nothing when a shared reader of that name is already published."
    ),
    name: str = typer.Option(DEFAULT_READER, "--name", help="Name the reader is published under."),
    kind: str = typer.Option(
        DEFAULT_KIND,
        "--kind",
        help="bi-encoder (the default: the collections' embedder tuned to read) or cross-encoder.",
    ),
    trainer_url: str | None = typer.Option(None, "--trainer-url", help="Default: the running stack's."),
    key_file: Path | None = typer.Option(
        None, "--key-file", help="Operator key (default $TANDEM_HOME/service-key)."
    ),
    wait: bool = typer.Option(False, "--wait", help="Wait until the job ends, printing its progress."),
) -> None:
    """Train the answer reader on ``--dataset`` and publish it for every tenant as ``--name``."""
    if kind not in KINDS:
        typer.echo(f"--kind {kind!r}: one of {', '.join(KINDS)}", err=True)
        raise typer.Exit(2)
    home = _home()
    if if_missing and (home / "models" / "readers" / "_shared" / name / "tandem_reader.json").is_file():
        typer.echo(f"the reader {name} is published: nothing to train")
        return
    url = trainer_url or _stack_url(home, "trainer")
    key = (key_file or home / "service-key").read_text().strip()
    held = None if no_eval_dataset else eval_dataset
    try:
        job = start_reader_job(url, key, dataset=dataset, eval_dataset=held, name=name, kind=kind)
    except (ReaderJobError, httpx.HTTPError, OSError) as exc:
        typer.echo(f"reader job not started: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"reader job {job.id}: publishes {job.name} when it ends (the Training page shows its "
        "progress; until then answers use the features scorer shipped with the agent)"
    )
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
