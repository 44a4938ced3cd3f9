"""Website sources: a start URL and the pages of the same host it links to.

The crawl is breadth-first from the start page (depth 0) to ``TANDEM_RETRIEVAL_SOURCE_WEB_MAX_DEPTH``
links away, fetching at most ``TANDEM_RETRIEVAL_SOURCE_WEB_MAX_PAGES`` URLs: HTML pages, and the
files they link to whose type a parser reads (PDF, DOCX, Markdown, text...). It stays on the
start URL's host, follows redirects only within it, honours robots.txt (``urllib.robotparser``,
under the user agent ``Tandem``; a robots.txt that cannot be read fails the sync rather than
being taken as permission) and a page's ``<meta name="robots">`` noindex / nofollow, and waits
a site's Crawl-delay (up to ``MAX_CRAWL_DELAY_S``). Every request goes through the outbound
address guard (services/common/outbound.py), checked at each connection, redirects included.

A page's path within the source is its URL's path and query (``/docs/guide?v=2``). Pages that
answer 404 or 410 are gone (their documents leave the collection); pages that fail otherwise
(5xx, a timeout, over the size limit) are errors of the sync and keep their documents. The
start page failing in any way fails the sync.

Links are found with the standard library's ``HTMLParser`` (linear in the page, which is
size-capped); the page itself is parsed for its text in the sandbox, like an upload.
"""

from __future__ import annotations

import asyncio
import urllib.robotparser
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from services.common.errors import InvalidRequest
from services.common.outbound import (
    GuardedTransport,
    RefusedAddress,
    Resolver,
    check_form,
    check_url,
    system_resolver,
)
from services.retrieval.core.parsing import SUPPORTED, extension_of
from services.retrieval.sources.fetched import Fetch, FetchedFile, SourceError, file_error

ROBOTS_AGENT = "Tandem"
USER_AGENT = "Tandem/0.1 (document source sync; robots.txt agent Tandem)"
MAX_REDIRECTS = 5
MAX_CRAWL_DELAY_S = 10.0
HTML_TYPES = ("text/html", "application/xhtml+xml")
# What a response's Content-Type says a file is, where its URL has no extension a parser reads.
TYPE_EXTENSIONS = {
    "text/markdown": ".md",
    "text/x-markdown": ".md",
    "text/plain": ".txt",
    "application/pdf": ".pdf",
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document": ".docx",
}


async def check_start_url(url: str, allow_private: bool, resolver: Resolver = system_resolver) -> str:
    """A website source's start URL (http or https, a public host unless ``allow_private``),
    without its fragment; InvalidRequest or RefusedAddress naming the problem."""
    try:
        check_form(url)
    except RefusedAddress as exc:
        raise InvalidRequest(f"url {url!r}: {exc}", param="url", code="bad_url") from None
    await check_url(url, resolver, allow_private=allow_private)
    return urlunsplit(urlsplit(url)._replace(fragment=""))


def page_key(url: str) -> str:
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


class _Links(HTMLParser):
    """The ``<a href>`` links, ``<base href>`` and robots ``<meta>`` of a page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.base: str | None = None
        self.robots = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k.lower(): v or "" for k, v in attrs}
        if tag == "a" and a.get("href"):
            self.links.append(a["href"].strip())
        elif tag == "base" and a.get("href") and self.base is None:
            self.base = a["href"].strip()
        elif tag == "meta" and a.get("name", "").lower() in ("robots", ROBOTS_AGENT.lower()):
            self.robots += "," + a.get("content", "").lower()


def _file_name(key: str, ext: str) -> str:
    """The name the parser sees for a page: its path, with the extension of its type."""
    path = key.split("?", 1)[0]
    if path.endswith("/"):
        path += "index"
    return path if extension_of(path) == ext else path + ext


def _ext_of(url: str, content_type: str) -> str | None:
    if content_type in HTML_TYPES:
        return ".html"
    ext = extension_of(urlsplit(url).path.rsplit("/", 1)[-1])
    if ext in SUPPORTED:
        return ext
    return TYPE_EXTENSIONS.get(content_type)


def _worth_fetching(url: str) -> bool:
    """A link to an HTML page (no extension, or .html) or to a file a parser reads; not to
    images, archives, scripts and the like, which would spend the page budget."""
    last = urlsplit(url).path.rsplit("/", 1)[-1]
    ext = extension_of(last)
    return not ext or ext in SUPPORTED or ext in (".htm", ".html", ".php", ".asp", ".aspx", ".jsp")


@dataclass
class Crawl:
    start: str
    dest: Path
    wanted: Callable[[str], bool]
    max_depth: int
    max_pages: int
    max_bytes: int
    timeout_s: float
    allow_private: bool
    resolver: Resolver = system_resolver
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    out: Fetch = field(default_factory=Fetch)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=GuardedTransport(resolver=self.resolver, allow_private=self.allow_private),
            timeout=self.timeout_s,
            follow_redirects=False,  # followed here: only within the host, each hop guarded
            headers={"User-Agent": USER_AGENT},
        )

    async def get(self, client: httpx.AsyncClient, url: str) -> tuple[str, httpx.Response, bytes]:
        """(final URL, response, body up to max_bytes + 1) following redirects on this host."""
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url) as resp:
                if resp.is_redirect and "location" in resp.headers:
                    nxt = urljoin(url, resp.headers["location"])
                    if _host(nxt) != _host(self.start) or urlsplit(nxt).scheme not in ("http", "https"):
                        raise _OffSite(nxt)
                    url = nxt
                    continue
                body = bytearray()
                if resp.status_code == 200:
                    async for piece in resp.aiter_bytes():
                        body += piece
                        if len(body) > self.max_bytes:
                            break
                return url, resp, bytes(body)
        raise httpx.TooManyRedirects(f"more than {MAX_REDIRECTS} redirects", request=None)  # type: ignore[arg-type]

    async def robots(self, client: httpx.AsyncClient) -> urllib.robotparser.RobotFileParser:
        parts = urlsplit(self.start)
        url = urlunsplit((parts.scheme, parts.netloc, "/robots.txt", "", ""))
        rp = urllib.robotparser.RobotFileParser(url)
        try:
            _, resp, body = await self.get(client, url)
        except _OffSite:
            rp.parse([])  # a robots.txt elsewhere does not speak for this host: no rules
            return rp
        except (httpx.HTTPError, RefusedAddress) as exc:
            raise SourceError(f"robots.txt of {parts.netloc} could not be read: {_why(exc)}") from None
        if resp.status_code == 200:
            rp.parse(body[: self.max_bytes].decode("utf-8", errors="replace").splitlines())
        elif resp.status_code in (401, 403):  # as urllib.robotparser.read takes them
            rp.parse(["User-agent: *", "Disallow: /"])
        elif 400 <= resp.status_code < 500:
            rp.parse([])
        else:
            raise SourceError(f"robots.txt of {parts.netloc} answered HTTP {resp.status_code}; not crawling")
        return rp

    async def run(self) -> Fetch:
        async with self.client() as client:
            rp = await self.robots(client)
            if not rp.can_fetch(ROBOTS_AGENT, self.start):
                raise SourceError(
                    f"robots.txt of {urlsplit(self.start).netloc} disallows the start URL {self.start}"
                )
            delay = min(float(rp.crawl_delay(ROBOTS_AGENT) or 0), MAX_CRAWL_DELAY_S)
            queue: deque[tuple[str, int]] = deque([(self.start, 0)])
            seen = {page_key(self.start)}
            fetched = 0
            while queue:
                if fetched >= self.max_pages:
                    left = {page_key(u) for u, _ in queue}
                    self.out.kept |= left
                    self.out.errors.append(
                        file_error(
                            "",
                            "page_limit",
                            f"stopped after {self.max_pages} pages (TANDEM_RETRIEVAL_SOURCE_WEB_MAX_PAGES); "
                            f"{len(left)} more linked pages were not fetched",
                        )
                    )
                    break
                url, depth = queue.popleft()
                if fetched and delay:
                    await self.sleep(delay)
                fetched += 1
                for link in await self.page(client, url, depth):
                    key = page_key(link)
                    if key in seen or not rp.can_fetch(ROBOTS_AGENT, link):
                        continue
                    seen.add(key)
                    queue.append((link, depth + 1))
        return self.out

    async def page(self, client: httpx.AsyncClient, url: str, depth: int) -> list[str]:
        """Fetch one URL, keep it when a parser reads it, and return the links to follow."""
        key = page_key(url)
        first = depth == 0
        try:
            final, resp, body = await self.get(client, url)
        except _OffSite as exc:
            if first:
                raise SourceError(f"start URL {url} redirects off the site, to {exc}") from None
            return []
        except (httpx.HTTPError, RefusedAddress) as exc:
            if first:
                raise SourceError(f"start URL {url} could not be fetched: {_why(exc)}") from None
            self.out.kept.add(key)
            self.out.errors.append(file_error(key, "fetch_failed", f"{url}: {_why(exc)}"))
            return []
        if resp.status_code != 200:
            if first:
                raise SourceError(f"start URL {url} answered HTTP {resp.status_code}")
            if resp.status_code not in (404, 410):  # gone: its documents leave; else they stay
                self.out.kept.add(key)
                self.out.errors.append(
                    file_error(key, "fetch_failed", f"{url} answered HTTP {resp.status_code}")
                )
            return []
        key = page_key(final)
        if len(body) > self.max_bytes:
            self.out.kept.add(key)
            self.out.errors.append(
                file_error(
                    key,
                    "file_too_large",
                    f"{final} is larger than {self.max_bytes >> 20} MiB (TANDEM_RETRIEVAL_SOURCE_MAX_FILE_MB)",
                )
            )
            return []
        content_type = resp.headers.get("content-type", "").split(";")[0].strip().lower()
        ext = _ext_of(final, content_type)
        links: list[str] = []
        robots = ""
        if ext == ".html":
            parser = _Links()
            parser.feed(body.decode(resp.encoding or "utf-8", errors="replace"))
            parser.close()
            robots = parser.robots
            if depth < self.max_depth and "nofollow" not in robots and "none" not in robots:
                base = urljoin(final, parser.base) if parser.base else final
                for href in parser.links:
                    link = urlunsplit(urlsplit(urljoin(base, href))._replace(fragment=""))
                    on_site = urlsplit(link).scheme in ("http", "https") and _host(link) == _host(self.start)
                    if on_site and _worth_fetching(link):
                        links.append(link)
        wanted_path = key.lstrip("/").split("?", 1)[0] or "index"
        indexable = "noindex" not in robots and "none" not in robots
        if ext is not None and indexable and self.wanted(wanted_path):
            local = self.dest / f"{len(self.out.files):06d}{ext}"
            local.write_bytes(body)
            self.out.files.append(FetchedFile(key, local, _file_name(key, ext), {"url": final}))
        return links


class _OffSite(Exception):
    """A redirect away from the source's host (its target is the message)."""


def _why(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def fetch_web(
    url: str,
    wanted: Callable[[str], bool],
    dest: Path,
    *,
    allow_private: bool,
    max_depth: int,
    max_pages: int,
    max_bytes: int,
    timeout_s: float,
) -> Fetch:
    dest.mkdir(parents=True, exist_ok=True)
    crawl = Crawl(url, dest, wanted, max_depth, max_pages, max_bytes, timeout_s, allow_private)
    try:
        return asyncio.run(crawl.run())
    except RefusedAddress as exc:
        raise SourceError(f"url {url!r}: {exc}") from None
