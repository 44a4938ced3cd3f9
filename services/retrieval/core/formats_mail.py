"""E-mail messages (.eml, read with the standard library's ``email`` package and its modern
policy) as documents.

The message is one document: its From, To, Cc, Date and Subject as header lines (and the names
of its attachments), then its body, the text/plain part where there is one, else the HTML part
read as any HTML page is (``parsing.html_document``). Its metadata holds the headers (the date
in ISO form) and what became of each attachment.

Each attachment of a supported type is a document of its own, parsed as an uploaded file of its
name would be (``parse_file``, the same limits) with the id ``<message id>/<attachment name>``;
an attached message (``message/rfc822`` or an ``.eml`` file) is read the same way, its own
attachments under its id, down to ``MAX_DEPTH`` levels. Attachments of other types, or nested
deeper, are listed in the message's metadata (``attachments_skipped``), and one that cannot be
parsed (corrupt, or past a limit) with its error (``attachments_failed``): the message and its
other attachments are still read.
"""

from __future__ import annotations

import mimetypes
import re
from collections.abc import Callable, Iterator
from email import message_from_bytes, policy
from email.message import EmailMessage, MIMEPart
from typing import Any

from services.common.errors import TandemError
from services.retrieval.core.format_errors import reading, unreadable
from services.retrieval.core.parsing import (
    SUPPORTED,
    InputDocument,
    _tidy,
    extension_of,
    html_document,
)
from services.retrieval.core.text_cleanup import fix_characters

# Parses one file: (name, data, document id) -> its documents (parse_file with the limits of the
# message it is attached to).
Parse = Callable[[str, bytes, str], list[InputDocument]]

# Levels of attachments: a message's own are level 1, those of a message attached to it level 2...
MAX_DEPTH = 3
HEADERS = ("From", "To", "Cc", "Date", "Subject")
# Longest header value kept in the metadata (a Subject can be any length).
META_CHARS = 1000
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def mail_documents(
    filename: str, data: bytes, *, doc_id: str, parse: Parse, keep_hidden_text: bool = False
) -> list[InputDocument]:
    """The message in ``data`` and its attachments, as documents. Text a reader of its HTML body
    cannot see is left out unless ``keep_hidden_text``."""
    with reading(filename, "EML"):
        msg = message_from_bytes(data, policy=policy.default)
        if not any(msg.get(h) for h in (*HEADERS, "Message-ID")):
            raise unreadable(filename, "EML", "no message headers (From, To, Date, Subject)")
    assert isinstance(msg, EmailMessage)  # policy.default makes EmailMessage objects
    return _Reader(parse, keep_hidden_text).message(filename, msg, doc_id, depth=0)


class _Reader:
    def __init__(self, parse: Parse, keep_hidden_text: bool) -> None:
        self.parse = parse
        self.keep_hidden_text = keep_hidden_text

    def message(self, filename: str, msg: EmailMessage, doc_id: str, depth: int) -> list[InputDocument]:
        with reading(filename, "EML"):
            headers = {h: " ".join(str(msg.get(h, "")).split()) for h in HEADERS}
            body, hidden = _body(msg, self.keep_hidden_text)
            parts = list(_attachments(msg))
            date = getattr(msg.get("Date"), "datetime", None)
        meta: dict[str, Any] = {"source": filename}
        meta.update({h.lower(): v[:META_CHARS] for h, v in headers.items() if v})
        if date is not None:
            meta["date"] = date.isoformat()
        docs: list[InputDocument] = []
        names: list[str] = []
        parsed: list[str] = []
        skipped: list[dict[str, str]] = []
        failed: list[dict[str, str]] = []
        for n, part in enumerate(parts, start=1):
            name = _unique(_name_of(part, n), names)
            names.append(name)
            kind = part.get_content_type()
            ext = extension_of(name)
            attached = kind == "message/rfc822" or ext == ".eml"
            if not attached and (
                ext not in SUPPORTED or ext == ".jsonl"
            ):  # a .jsonl's lines have ids of their own
                skipped.append({"name": name, "type": kind, "reason": f"unsupported type {ext or kind}"})
                continue
            if depth + 1 > MAX_DEPTH:
                skipped.append(
                    {"name": name, "type": kind, "reason": f"nested deeper than {MAX_DEPTH} levels"}
                )
                continue
            att_id = f"{doc_id}/{name}"
            try:
                if attached:
                    with reading(name, "EML"):
                        inner = _attached_message(part)
                    found = self.message(name, inner, att_id, depth + 1)
                else:
                    found = self.parse(name, _payload(part), att_id)
            except TandemError as exc:
                failed.append({"name": name, "error": exc.message})
                continue
            for d in found:  # the file uploaded is their source; the part holding them, their parent
                d.metadata = {"attachment_of": doc_id, **d.metadata, "source": filename}
            parsed.append(name)
            docs.extend(found)
        if parsed:
            meta["attachments"] = parsed
        if skipped:
            meta["attachments_skipped"] = skipped
        if failed:
            meta["attachments_failed"] = failed
        lines = [f"{h}: {v}" for h, v in headers.items() if v]
        if names:
            lines.append("Attachments: " + ", ".join(names))
        text = "\n".join(lines) + ("\n\n" + body if body else "")
        title = headers["Subject"] or filename
        return [InputDocument(doc_id, text, title, meta, {}, hidden), *docs]


def _body(msg: EmailMessage, keep_hidden_text: bool) -> tuple[str, int]:
    """(text, hidden pieces) of the message's body: text/plain where there is one, else HTML."""
    part = msg.get_body(preferencelist=("plain", "html"))
    if part is None:
        return "", 0
    content = _text_of(part)
    if part.get_content_subtype() == "html":
        text, _title, _anchors, hidden = html_document(content, keep_hidden_text)
        return text, hidden
    return fix_characters(_tidy(content.replace("\r\n", "\n").replace("\r", "\n"))), 0


def _text_of(part: MIMEPart) -> str:
    """A text part's content, decoded from its charset (as UTF-8 where it names none it knows)."""
    try:
        return str(part.get_content())
    except (LookupError, UnicodeError):  # an unknown or wrong charset
        raw = part.get_payload(decode=True)
        return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else ""


def _attachments(msg: MIMEPart) -> Iterator[MIMEPart]:
    """The message's attachments, looking into the multiparts among them (a forwarded group)."""
    for part in msg.iter_attachments():
        if part.get_content_maintype() == "multipart":
            for sub in part.iter_parts():
                if sub.get_content_maintype() == "multipart":
                    yield from _attachments(sub)
                else:
                    yield sub
        else:
            yield part


def _attached_message(part: MIMEPart) -> EmailMessage:
    """The message a ``message/rfc822`` part or an attached ``.eml`` file holds."""
    inner = part.get_content() if part.get_content_type() == "message/rfc822" else None
    if not isinstance(inner, EmailMessage):
        inner = message_from_bytes(_payload(part), policy=policy.default)
    assert isinstance(inner, EmailMessage)
    return inner


def _payload(part: MIMEPart) -> bytes:
    if part.get_content_maintype() == "text":
        return _text_of(part).encode("utf-8")  # text is parsed as UTF-8, whatever it was sent in
    raw = part.get_payload(decode=True)
    return raw if isinstance(raw, bytes) else b""


def _name_of(part: MIMEPart, n: int) -> str:
    """The attachment's file name, as a plain name (no folders, no control characters); one
    from its type (an attached message's from its subject) where it has none."""
    name = _plain(part.get_filename() or "")
    if name:
        return name
    kind = part.get_content_type()
    if kind == "message/rfc822":
        inner = part.get_content()
        subject = _plain(str(inner.get("Subject", "")))[:100] if isinstance(inner, EmailMessage) else ""
        return f"{subject or f'message-{n}'}.eml"
    ext = {"text/plain": ".txt", "text/markdown": ".md"}.get(kind) or mimetypes.guess_extension(kind) or ""
    return f"attachment-{n}{ext}"


def _plain(name: str) -> str:
    name = _CONTROL.sub(" ", name.replace("\\", "/").rsplit("/", 1)[-1])
    return " ".join(name.split()).strip(" .")[:200]


def _unique(name: str, taken: list[str]) -> str:
    """``name``, or ``name (2)`` and so on when an earlier attachment has it."""
    if name not in taken:
        return name
    stem, dot, ext = name.rpartition(".")
    stem, ext = (stem, f".{ext}") if dot and stem else (name, "")
    k = 2
    while f"{stem} ({k}){ext}" in taken:
        k += 1
    return f"{stem} ({k}){ext}"
