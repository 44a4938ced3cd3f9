"""Start a Milvus Lite server (the ``milvus-lite`` package's engine) on a TCP port, for tests,
development and one-machine set-ups that want the Milvus backend.

``python -m services.retrieval.milvus.lite DATA.db --port 19530`` serves until interrupted;
point ``TANDEM_RETRIEVAL_MILVUS_URI`` at ``http://127.0.0.1:19530``. The binary is run directly
rather than through ``milvus_lite.server``: that package imports ``pkg_resources``, which
setuptools 81 removed. milvus-lite is pinned to 2.5.1, the last release that ships the
Milvus engine itself (3.x is a pure-Python re-implementation).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def binary() -> Path:
    spec = importlib.util.find_spec("milvus_lite")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("milvus-lite is not installed (pip install 'milvus-lite==2.5.1')")
    path = Path(next(iter(spec.submodule_search_locations))) / "lib" / "milvus"
    if not path.exists():
        raise RuntimeError(f"milvus-lite has no server binary at {path} (install milvus-lite==2.5.1)")
    return path


def _die_with_parent() -> None:
    """In the child before exec: Linux sends it SIGTERM when the process that started it dies,
    so a killed test run or launcher leaves no server behind."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start(db_file: Path, port: int, timeout: float = 60.0) -> subprocess.Popen[bytes]:
    """Start the server on 127.0.0.1:``port`` with its data in ``db_file``; returns once it
    accepts connections (or raises, with the server stopped)."""
    exe = binary()
    db_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{exe.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    log = open(db_file.with_suffix(".log"), "ab")  # noqa: SIM115 - the server's stdout for its lifetime
    proc = subprocess.Popen(
        [str(exe), str(db_file), f"127.0.0.1:{port}", os.environ.get("MILVUS_LITE_LOG_LEVEL", "ERROR")],
        cwd=db_file.parent,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    log.close()
    deadline = time.monotonic() + timeout
    while not _listening(port):
        if proc.poll() is not None:
            raise RuntimeError(
                f"Milvus Lite exited with {proc.returncode}; see {db_file.with_suffix('.log')}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"Milvus Lite did not listen on port {port} within {timeout:.0f}s")
        time.sleep(0.1)
    return proc


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("db_file", type=Path)
    ap.add_argument("--port", type=int, default=19530)
    args = ap.parse_args()
    proc = start(args.db_file.absolute(), args.port)
    # SIGTERM (what supervisors and tests send) stops the server too, like Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"Milvus Lite on http://127.0.0.1:{args.port} (data {args.db_file})", flush=True)
    try:
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
