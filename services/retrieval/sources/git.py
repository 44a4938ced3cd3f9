"""Git sources, read with ``git`` itself.

The first sync clones the branch at depth 1 into ``<collection>/sources/<id>/git``; later ones
fetch it at depth 1 and reset the work tree to what was fetched (a checkout that cannot be
updated is cloned again beside it, then swapped in). Git runs with nothing of the server's user:
no global or system config (so no credential helpers, URL rewrites or hooks paths), no
terminal prompts, hooks pointed at nothing, links checked out as plain files, only the
protocols the URL needs, no submodules, and a time limit. An http(s) URL's host is checked
by the outbound address guard (services/common/outbound.py) before git runs, git is told to
connect to the address checked (``http.curloptResolve``, so a DNS answer that changes after
the check is not followed) and not to follow redirects. ``file://`` URLs must lie under
``TANDEM_RETRIEVAL_SOURCE_ROOTS``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from services.common.errors import InvalidRequest
from services.common.outbound import RefusedAddress, Resolver, check_form, check_host, system_resolver
from services.common.paths import resolve_under_roots
from services.retrieval.sources.fetched import Fetch, SourceError, walk_files

ROOTS_SETTING = "TANDEM_RETRIEVAL_SOURCE_ROOTS"
# A branch or tag name git accepts, and nothing an option parser could take for an option.
_BRANCH_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._/-+")


def check_branch(branch: str) -> str:
    bad = (
        not branch
        or branch.startswith(("-", "/", "."))
        or branch.endswith(("/", ".", ".lock"))
        or ".." in branch
        or "//" in branch
        or not set(branch) <= _BRANCH_CHARS
    )
    if bad:
        raise InvalidRequest(
            f"branch {branch!r} is not a branch name (letters, digits and . _ / - +, not starting "
            "with '-', '/' or '.', no '..')",
            param="branch",
            code="bad_branch",
        )
    return branch


def local_repo(url: str, roots: list[Path]) -> Path:
    """The folder of a ``file://`` URL, which must lie under the allowed roots."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequest(f"url {url!r}: a file:// URL names no host", param="url")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise InvalidRequest(f"url {url!r}: a file:// URL needs an absolute path", param="url")
    try:
        return resolve_under_roots(path, roots, param="url", setting=ROOTS_SETTING, what="source roots")
    except InvalidRequest as exc:  # named by the URL the client sent
        raise InvalidRequest(f"url {url!r}: {exc.message.removeprefix('url: ')}", param="url") from None


@dataclass(frozen=True)
class Remote:
    """Where git connects: the URL, and for http(s) the ``host:port:address`` it is pinned to."""

    url: str
    protocol: str  # what git may speak: "file", "https" or "http"
    resolve: str | None = None


async def check_remote(
    url: str, roots: list[Path], allow_private: bool, resolver: Resolver = system_resolver
) -> Remote:
    """A Git URL git may be run on, or InvalidRequest / RefusedAddress naming what is wrong."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "file":
        repo = local_repo(url, roots)
        return Remote(repo.as_uri(), "file")
    if scheme not in ("http", "https"):
        raise InvalidRequest(
            f"url {url!r}: a Git source is an https://, http:// or file:// URL", param="url", code="bad_url"
        )
    try:
        target = check_form(url)
    except RefusedAddress as exc:
        raise InvalidRequest(f"url {url!r}: {exc}", param="url", code="bad_url") from None
    if allow_private:
        return Remote(url, scheme)
    address = await check_host(target.host, target.port, resolver)
    shown = (
        f"[{address}]"
        if isinstance(ipaddress.ip_address(address.split("%")[0]), ipaddress.IPv6Address)
        else address
    )
    return Remote(url, scheme, f"{target.host}:{target.port}:{shown}")


def _git_env(home: Path, protocol: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),  # an empty folder: no ~/.gitconfig, ~/.netrc or credential store
        "LANG": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "/bin/false",
        "SSH_ASKPASS": "/bin/false",
        "GIT_ALLOW_PROTOCOL": protocol,
        "GIT_LFS_SKIP_SMUDGE": "1",
    }


def _git_options(remote: Remote) -> list[str]:
    opts = {
        "core.hooksPath": os.devnull,
        "core.symlinks": "false",
        "core.fsmonitor": "false",
        "credential.helper": "",
        "http.followRedirects": "false",
        "protocol.allow": "never",
        f"protocol.{remote.protocol}.allow": "always",
        "submodule.recurse": "false",
        "advice.detachedHead": "false",
        "gc.auto": "0",
    }
    if remote.resolve:
        opts["http.curloptResolve"] = remote.resolve
    return [arg for k, v in opts.items() for arg in ("-c", f"{k}={v}")]


@dataclass
class Git:
    remote: Remote
    home: Path
    timeout_s: float

    def run(self, *args: str, cwd: Path | None = None) -> str:
        git = shutil.which("git")
        if git is None:
            raise SourceError("git is not installed on this server")
        try:
            proc = subprocess.run(
                [git, *_git_options(self.remote), *args],
                cwd=cwd,
                env=_git_env(self.home, self.remote.protocol),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=self.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise SourceError(
                f"git {args[0]} of {self.remote.url} took longer than {self.timeout_s:g} s "
                "(TANDEM_RETRIEVAL_SOURCE_GIT_TIMEOUT_S)"
            ) from None
        if proc.returncode != 0:
            lines = [ln.strip() for ln in proc.stderr.decode(errors="replace").splitlines() if ln.strip()]
            why = "; ".join(lines[-2:]) or f"exit status {proc.returncode}"
            raise SourceError(f"git {args[0]} of {self.remote.url} failed: {why}")
        return proc.stdout.decode(errors="replace").strip()


def _shallow(run: Callable[[list[str]], str]) -> str:
    """``run`` at depth 1, or whole where the server cannot serve a shallow history (a "dumb"
    HTTP server, serving the repository's files as they are)."""
    try:
        return run(["--depth", "1"])
    except SourceError as exc:
        if "shallow" not in str(exc):
            raise
        return run([])


def _clone(git: Git, branch: str | None, dest: Path) -> None:
    pick = ["--branch", branch] if branch else []

    def clone(depth: list[str]) -> str:
        shutil.rmtree(dest, ignore_errors=True)
        return git.run(
            "clone", *depth, "--single-branch", "--no-tags", *pick, "--", git.remote.url, str(dest)
        )

    _shallow(clone)


def _update(git: Git, branch: str | None, work: Path) -> None:
    _shallow(
        lambda depth: git.run("fetch", *depth, "--no-tags", "--force", "origin", branch or "HEAD", cwd=work)
    )
    git.run("reset", "--hard", "--quiet", "FETCH_HEAD", cwd=work)
    git.run("clean", "-ffdxq", cwd=work)


def checkout(remote: Remote, branch: str | None, cache: Path, timeout_s: float) -> tuple[Path, str]:
    """The branch's files now, in ``cache/git``, and the commit they are of."""
    home = cache / "home"
    home.mkdir(parents=True, exist_ok=True)
    git = Git(remote, home, timeout_s)
    work = cache / "git"
    if (work / ".git").is_dir():
        try:
            _update(git, branch, work)
            return work, git.run("rev-parse", "HEAD", cwd=work)
        except SourceError:
            pass  # a checkout that cannot be updated: a fresh clone decides whether the source is gone
    fresh = cache / f".clone-{uuid.uuid4().hex[:8]}"
    try:
        _clone(git, branch, fresh)
    except SourceError:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    if work.exists():
        old = cache / f".old-{uuid.uuid4().hex[:8]}"
        work.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    fresh.rename(work)
    return work, git.run("rev-parse", "HEAD", cwd=work)


def fetch_git(
    url: str,
    branch: str | None,
    wanted: Callable[[str], bool],
    cache: Path,
    *,
    roots: list[Path],
    allow_private: bool,
    timeout_s: float,
    max_files: int,
    max_bytes: int,
) -> Fetch:
    try:
        remote = asyncio.run(check_remote(url, roots, allow_private))
    except (InvalidRequest, RefusedAddress, ValueError) as exc:
        raise SourceError(f"url {url!r}: {getattr(exc, 'message', None) or exc}") from None
    work, commit = checkout(remote, branch, cache, timeout_s)
    out = walk_files(work, wanted, max_files, max_bytes, skip=(".git",))
    out.commit = commit
    return out
