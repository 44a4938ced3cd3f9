"""``tandem reader``: the answer reader, a cross-encoder that scores whether a sentence of a
document answers a question.

``tandem reader dataset [--docs DIR] [--out FILE] [--seed N]`` builds its training rows from the
FAQs of four Debian documentation packages unpacked under ``DIR`` (default
``$TANDEM_ANSWER_DOCS``, else ``~/.cache/tandem/answer-docs``; ``python -m
benchmarks.answers.fetch`` puts them there): JSONL to ``FILE`` (gzip when it ends in ``.gz``) or
stdout, and a one-line summary to stderr. The rules live with the trainer, which owns its data
formats (``services/trainer/data/faq.py``); the command runs that module as a child process,
as the stack runs the trainer's workers, so the CLI imports no service code.

The group holds the reader's commands; more join it with ``@reader_app.command(...)``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

# the trainer's dataset builder, run as ``python -m``
DATASET_MODULE = "services.trainer.data.faq"

reader_app = typer.Typer(help="The answer reader: its training data.", no_args_is_help=True)


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


__all__ = ["dataset_command", "reader_app"]
