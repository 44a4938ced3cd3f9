"""Dataset formats: parse JSONL rows into one typed record per job kind.

Every row is checked when the file is uploaded, so a job never starts on a file
that would fail half-way. Errors name the line (1-based) and the field.

Accepted formats (detected from the first row; every later row must match it):

============  =====================================================  ===========
format        fields of a row                                        usable for
============  =====================================================  ===========
alpaca        ``instruction``, ``input``?, ``output``, ``system``?  sft, rl
sharegpt      ``conversations``: [{``from``, ``value``}]            sft
messages      ``messages``: [{``role``, ``content``}] (OpenAI)      sft, rl
completion    ``prompt``, ``completion``                             sft, rl
gsm8k         ``question``, ``answer``                               sft, rl
preference    ``prompt``, ``chosen``, ``rejected`` (str or messages) dpo
kto           ``prompt`` (str or messages), ``completion``, ``label``  kto
hh-rlhf       ``chosen``, ``rejected`` (whole ``Human:/Assistant:``) dpo
prompt        ``prompt`` (str or messages), ``answer``?              rl
pairs         ``query``, ``positive``, ``negatives``? (list of str),  embedder
              ``document_id``? (the collection's document),
              ``title_of``? (a snapshot's title pair: its document)
beir          corpus ``corpus_id``, ``text``, ``title``?;            embedder
              query ``query_id``, ``text``;
              qrel ``query_id``, ``corpus_id``, ``score``? (1)
reader        ``question``, ``sentence``, ``label`` (0 or 1),        reader
              ``context``? (the sentence's section and headings),
              ``source``?, ``group``? (held out whole),
              ``features``? (name -> number: a
              ``"reader_kind": "features"`` job's inputs)
============  =====================================================  ===========

A ``beir`` file is BEIR's corpus, queries and qrels in one JSONL file (rows of the three
shapes in any order): every qrel with a score above 0 makes a training pair of its query and
document, and the whole corpus is what held-out queries are ranked against. A qrel naming a
query or document the file lacks is refused with its line and field.

Records (what the tokenizer side sees; each keeps its 1-based ``line``):

- sft: :class:`ChatRecord`, whose ``messages`` hold at least one assistant message (it is an
  rl :class:`PromptRecord` too: the messages before the last assistant one, and its text);
- dpo: :class:`PreferenceRecord`: the prompt messages and the two assistant continuations;
- kto: :class:`KTORecord`: the prompt messages, the assistant continuation, and whether it
  is desirable;
- rl: :class:`PromptRecord`: the reference answer is what a verifiable reward (GSM8K exact
  match) checks against;
- embedder: :class:`PairRecord` (pairs), or a beir :class:`BeirDoc`, :class:`BeirQuery` or
  :class:`BeirQrel` that ``services/trainer/data/pairs.py`` resolves;
- reader: :class:`ReaderRecord`: a question, a candidate sentence with its context, and
  whether the sentence answers the question.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from services.common import jsonsafe

Kind = Literal["sft", "dpo", "kto", "rl", "embedder", "reader"]
Message = dict[str, str]

FORMAT_KINDS: dict[str, tuple[Kind, ...]] = {
    "alpaca": ("sft", "rl"),
    "sharegpt": ("sft",),
    "messages": ("sft", "rl"),
    "completion": ("sft", "rl"),
    "gsm8k": ("sft", "rl"),
    "preference": ("dpo",),
    "kto": ("kto",),
    "hh-rlhf": ("dpo",),
    "prompt": ("rl",),
    "pairs": ("embedder",),
    "beir": ("embedder",),
    "reader": ("reader",),
}
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
MAX_ERRORS = 5


class DatasetError(ValueError):
    """A dataset row is malformed; ``line`` is 1-based, ``field`` the offending key."""

    def __init__(self, message: str, *, line: int | None = None, field: str | None = None) -> None:
        where = f"line {line}: " if line is not None else ""
        super().__init__(where + message)
        self.line = line
        self.field = field


@dataclass(frozen=True)
class PromptRecord:
    """rl: the prompt and the reference answer a verifiable reward checks, if the row has one."""

    prompt: list[Message]
    answer: str | None
    line: int


@dataclass(frozen=True)
class ChatRecord(PromptRecord):
    """sft (and rl): the whole conversation."""

    messages: list[Message]


@dataclass(frozen=True)
class PreferenceRecord:
    """dpo: the prompt, then the chosen and the rejected assistant continuation."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    line: int


@dataclass(frozen=True)
class KTORecord:
    """kto: the prompt, an assistant continuation, and whether it is desirable."""

    prompt: list[Message]
    completion: list[Message]
    label: bool
    line: int


@dataclass(frozen=True)
class PairRecord:
    """embedder: a query, its positive text and its own negatives."""

    query: str
    positive: str
    negatives: list[str]
    line: int
    document_id: str | None = None  # the collection document the positive comes from
    title_of: str | None = None  # a collection snapshot's title or heading pair: its document


@dataclass(frozen=True)
class BeirDoc:
    """A beir document: what held-out queries are ranked against."""

    corpus_id: str
    text: str
    title: str
    line: int


@dataclass(frozen=True)
class BeirQuery:
    """A beir query."""

    query_id: str  # what its qrels name it by
    text: str
    line: int


@dataclass(frozen=True)
class BeirQrel:
    """A beir relevance judgement: above 0, a training pair of its query and document."""

    query_id: str
    corpus_id: str
    score: float
    line: int


@dataclass(frozen=True)
class ReaderRecord:
    """reader: does ``sentence`` (under ``context``, its section and headings) answer ``question``?"""

    question: str
    sentence: str
    label: int  # 1: it answers, 0: it does not
    line: int
    context: str | None = None
    source: str | None = None  # where the sentence comes from (a document), for the record
    group: str | None = None  # rows of one group (a document set) are held out together
    # the answer step's signals for this sentence (services/agent/reader/features.py): what a
    # "reader_kind": "features" job trains on
    features: dict[str, float] | None = None


Record = (
    PromptRecord | PreferenceRecord | KTORecord | PairRecord | BeirDoc | BeirQuery | BeirQrel | ReaderRecord
)
R = TypeVar("R")


def of_kind(records: Sequence[object], cls: type[R]) -> list[R]:
    """``records`` as ``cls``; one of another type is a caller's bug (a dataset of the wrong kind)."""
    out = [r for r in records if isinstance(r, cls)]
    if len(out) != len(records):
        raise TypeError(f"expected {cls.__name__} records")
    return out


@dataclass
class ParsedDataset:
    format: str
    kinds: tuple[Kind, ...]
    records: list[Record] = field(default_factory=list)


def detect_format(row: dict[str, Any]) -> str | None:
    keys = set(row)
    if "sentence" in keys:  # before "question" (gsm8k) and "label" (kto), which reader rows share
        return "reader"
    if "query" in keys or "positive" in keys:
        return "pairs"
    if "query_id" in keys or "corpus_id" in keys:
        return "beir"
    if "conversations" in keys:
        return "sharegpt"
    if "chosen" in keys or "rejected" in keys:
        return "preference" if "prompt" in keys else "hh-rlhf"
    if "label" in keys:
        return "kto"
    if "messages" in keys:
        return "messages"
    if "instruction" in keys or "output" in keys:
        return "alpaca"
    if "question" in keys:
        return "gsm8k"
    if "completion" in keys:
        return "completion"
    if "prompt" in keys:
        return "prompt"
    return None


def _text(row: dict[str, Any], key: str, line: int, *, required: bool = True, fmt: str = "") -> str:
    if key not in row or row[key] is None:
        if required:
            raise DatasetError(f"field {key!r} is missing ({fmt} rows need it)", line=line, field=key)
        return ""
    value = row[key]
    if not isinstance(value, str):
        raise DatasetError(
            f"field {key!r} must be a string, got {type(value).__name__}", line=line, field=key
        )
    if required and not value.strip():
        raise DatasetError(f"field {key!r} is empty", line=line, field=key)
    return value


def _messages(
    value: Any, line: int, key: str, *, role_key: str = "role", content_key: str = "content"
) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise DatasetError(f"field {key!r} must be a non-empty list of messages", line=line, field=key)
    out: list[Message] = []
    for i, msg in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(msg, dict):
            raise DatasetError(f"field {where!r} must be an object", line=line, field=where)
        role = msg.get(role_key)
        if role_key == "from":
            role = SHAREGPT_ROLES.get(str(role).lower()) if role is not None else None
        if role not in ROLES:
            raise DatasetError(
                f"field '{where}.{role_key}' must be one of {', '.join(ROLES) if role_key == 'role' else ', '.join(SHAREGPT_ROLES)}"
                f" (got {msg.get(role_key)!r})",
                line=line,
                field=f"{where}.{role_key}",
            )
        content = msg.get(content_key)
        if not isinstance(content, str):
            raise DatasetError(
                f"field '{where}.{content_key}' must be a string", line=line, field=f"{where}.{content_key}"
            )
        out.append({"role": str(role), "content": content})
    return out


def _prompt_messages(value: Any, line: int, key: str = "prompt") -> list[Message]:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"field {key!r} is empty", line=line, field=key)
        return [{"role": "user", "content": value}]
    msgs = _messages(value, line, key)
    if msgs[-1]["role"] == "assistant":
        raise DatasetError(f"field {key!r} must not end with an assistant message", line=line, field=key)
    return msgs


def _continuation(value: Any, line: int, key: str) -> list[Message]:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"field {key!r} is empty", line=line, field=key)
        return [{"role": "assistant", "content": value}]
    msgs = _messages(value, line, key)
    if msgs[-1]["role"] != "assistant":
        raise DatasetError(f"field {key!r} must end with an assistant message", line=line, field=key)
    return msgs


HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def parse_hh_dialogue(text: str) -> list[Message]:
    """``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` into messages."""
    parts = HH_TURN.split(text)
    if parts[0].strip():
        raise ValueError("text before the first 'Human:' turn")
    msgs = []
    for speaker, content in zip(parts[1::2], parts[2::2], strict=True):
        msgs.append({"role": "user" if speaker == "Human" else "assistant", "content": content.strip()})
    return msgs


def split_hh_pair(chosen: str, rejected: str) -> tuple[list[Message], list[Message], list[Message]]:
    """Split an HH-RLHF pair at the last shared ``Assistant:`` turn: (prompt, chosen, rejected).

    The two dialogues share everything up to and including the last ``Assistant:``
    tag they both reach at the same offset; what follows is the answer being judged.
    """
    tag = "\n\nAssistant:"
    limit = 0
    while limit < min(len(chosen), len(rejected)) and chosen[limit] == rejected[limit]:
        limit += 1
    cut = chosen.rfind(tag, 0, limit)
    if cut < 0:
        raise ValueError("the two dialogues share no 'Assistant:' turn")
    prompt = parse_hh_dialogue(chosen[:cut])
    if not prompt or prompt[-1]["role"] != "user":
        raise ValueError("the shared part does not end with a 'Human:' turn")
    answer_c = chosen[cut + len(tag) :].strip()
    answer_r = rejected[cut + len(tag) :].strip()
    return prompt, [{"role": "assistant", "content": answer_c}], [{"role": "assistant", "content": answer_r}]


def normalise_row(fmt: str, row: dict[str, Any], line: int) -> Record:
    """One row of format ``fmt`` into the record of the kinds it supports."""
    if fmt == "alpaca":
        instruction = _text(row, "instruction", line, fmt=fmt)
        extra = _text(row, "input", line, required=False)
        output = _text(row, "output", line, fmt=fmt)
        system = _text(row, "system", line, required=False)
        prompt = [{"role": "system", "content": system}] if system else []
        prompt.append(
            {"role": "user", "content": f"{instruction}\n\n{extra}" if extra.strip() else instruction}
        )
        return ChatRecord(prompt, output, line, [*prompt, {"role": "assistant", "content": output}])
    if fmt in ("sharegpt", "messages"):
        key = "conversations" if fmt == "sharegpt" else "messages"
        if key not in row:
            raise DatasetError(f"field {key!r} is missing ({fmt} rows need it)", line=line, field=key)
        msgs = (
            _messages(row[key], line, key, role_key="from", content_key="value")
            if fmt == "sharegpt"
            else _messages(row[key], line, key)
        )
        if msgs[-1]["role"] == "assistant":
            return ChatRecord(msgs[:-1], msgs[-1]["content"], line, msgs)
        answer = row.get("answer")
        return ChatRecord(msgs, None if answer is None else str(answer), line, msgs)
    if fmt in ("completion", "gsm8k"):
        pk, ck = ("prompt", "completion") if fmt == "completion" else ("question", "answer")
        prompt_text = _text(row, pk, line, fmt=fmt)
        completion = _text(row, ck, line, fmt=fmt)
        prompt = [{"role": "user", "content": prompt_text}]
        return ChatRecord(prompt, completion, line, [*prompt, {"role": "assistant", "content": completion}])
    if fmt == "preference":
        if "prompt" not in row:
            raise DatasetError(
                "field 'prompt' is missing (preference rows need it)", line=line, field="prompt"
            )
        for key in ("chosen", "rejected"):
            if key not in row:
                raise DatasetError(
                    f"field {key!r} is missing (preference rows need it)", line=line, field=key
                )
        return PreferenceRecord(
            _prompt_messages(row["prompt"], line),
            _continuation(row["chosen"], line, "chosen"),
            _continuation(row["rejected"], line, "rejected"),
            line,
        )
    if fmt == "kto":
        for key in ("prompt", "completion", "label"):
            if key not in row:
                raise DatasetError(f"field {key!r} is missing (kto rows need it)", line=line, field=key)
        if not isinstance(row["label"], bool):
            raise DatasetError(
                f"field 'label' must be true or false, got {row['label']!r}", line=line, field="label"
            )
        if not isinstance(row["completion"], str):
            raise DatasetError(
                f"field 'completion' must be a string, got {type(row['completion']).__name__}",
                line=line,
                field="completion",
            )
        return KTORecord(
            _prompt_messages(row["prompt"], line),
            _continuation(row["completion"], line, "completion"),
            row["label"],
            line,
        )
    if fmt == "hh-rlhf":
        chosen = _text(row, "chosen", line, fmt=fmt)
        rejected = _text(row, "rejected", line, fmt=fmt)
        try:
            prompt, c, r = split_hh_pair(chosen, rejected)
        except ValueError as exc:
            raise DatasetError(f"field 'chosen'/'rejected': {exc}", line=line, field="chosen") from None
        return PreferenceRecord(prompt, c, r, line)
    if fmt == "prompt":
        if "prompt" not in row:
            raise DatasetError("field 'prompt' is missing (prompt rows need it)", line=line, field="prompt")
        answer = row.get("answer")
        if answer is not None and not isinstance(answer, str | int | float):
            raise DatasetError("field 'answer' must be a string or a number", line=line, field="answer")
        return PromptRecord(
            _prompt_messages(row["prompt"], line), None if answer is None else str(answer), line
        )
    if fmt == "pairs":
        return _pair_row(row, line)
    if fmt == "beir":
        return _beir_row(row, line)
    if fmt == "reader":
        return _reader_row(row, line)
    raise DatasetError(f"unknown format {fmt!r}")


def _pair_row(row: dict[str, Any], line: int) -> PairRecord:
    query = _text(row, "query", line, fmt="pairs")
    positive = _text(row, "positive", line, fmt="pairs")
    negatives = row.get("negatives") or []
    if not isinstance(negatives, list):
        raise DatasetError("field 'negatives' must be a list of strings", line=line, field="negatives")
    for i, neg in enumerate(negatives):
        if not isinstance(neg, str) or not neg.strip():
            raise DatasetError(
                f"field 'negatives[{i}]' must be a non-empty string", line=line, field=f"negatives[{i}]"
            )
    # the document is checked against a job's collection
    document_id = _beir_id(row, "document_id", line) if row.get("document_id") is not None else None
    title_of = _beir_id(row, "title_of", line) if row.get("title_of") is not None else None
    return PairRecord(query, positive, list(negatives), line, document_id, title_of)


def _beir_id(row: dict[str, Any], key: str, line: int) -> str:
    value = row[key]
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"field {key!r} must be a non-empty string or integer", line=line, field=key)
    return value


def _beir_row(row: dict[str, Any], line: int) -> BeirDoc | BeirQuery | BeirQrel:
    has_q, has_c = "query_id" in row, "corpus_id" in row
    if has_q and has_c:
        score = row.get("score", 1)
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise DatasetError(f"field 'score' must be a number, got {score!r}", line=line, field="score")
        return BeirQrel(_beir_id(row, "query_id", line), _beir_id(row, "corpus_id", line), float(score), line)
    if has_c:
        title = _text(row, "title", line, required=False)
        return BeirDoc(
            _beir_id(row, "corpus_id", line), _text(row, "text", line, fmt="beir corpus"), title, line
        )
    if has_q:
        return BeirQuery(_beir_id(row, "query_id", line), _text(row, "text", line, fmt="beir query"), line)
    raise DatasetError(
        "a beir row needs 'corpus_id' (a document), 'query_id' (a query) or both (a qrel)", line=line
    )


def _reader_row(row: dict[str, Any], line: int) -> ReaderRecord:
    label = row.get("label")
    if label not in (0, 1):  # true and false are 1 and 0 too
        raise DatasetError(
            f"field 'label' must be 1 (the sentence answers) or 0 (it does not), got {label!r}"
            + (" (reader rows need it)" if label is None else ""),
            line=line,
            field="label",
        )
    return ReaderRecord(
        question=_text(row, "question", line, fmt="reader"),
        sentence=_text(row, "sentence", line, fmt="reader"),
        label=int(label),
        line=line,
        context=_text(row, "context", line, required=False) or None,
        source=_text(row, "source", line, required=False) or None,
        group=_beir_id(row, "group", line) if row.get("group") is not None else None,
        features=_features(row, line) if row.get("features") is not None else None,
    )


MAX_FEATURES = 256


def _features(row: dict[str, Any], line: int) -> dict[str, float]:
    value = row["features"]
    if not isinstance(value, dict) or not value or len(value) > MAX_FEATURES:
        raise DatasetError(
            f"field 'features' must be an object of 1 to {MAX_FEATURES} names to numbers",
            line=line,
            field="features",
        )
    out: dict[str, float] = {}
    for name, number in value.items():
        if (
            not isinstance(number, int | float)
            or isinstance(number, bool)
            or not math.isfinite(number)
            or len(name) > 64
        ):
            raise DatasetError(
                f"field 'features.{name[:64]}' must be a finite number, got {number!r}"[:200],
                line=line,
                field="features",
            )
        out[name] = float(number)
    return out


def check_beir(records: list[Record]) -> None:
    """Every qrel must name a query and a document of the file, and some qrel must be positive."""
    docs = {r.corpus_id for r in records if isinstance(r, BeirDoc)}
    queries = {r.query_id for r in records if isinstance(r, BeirQuery)}
    positive = 0
    for r in records:
        if not isinstance(r, BeirQrel):
            continue
        if r.query_id not in queries:
            raise DatasetError(
                f"qrel names query_id {r.query_id!r}, which no query row of the file has",
                line=r.line,
                field="query_id",
            )
        if r.corpus_id not in docs:
            raise DatasetError(
                f"qrel names corpus_id {r.corpus_id!r}, which no document row of the file has",
                line=r.line,
                field="corpus_id",
            )
        positive += r.score > 0
    if not positive:
        raise DatasetError("a beir file needs at least one qrel row with a score above 0", field="score")


@dataclass
class BeirPartError(ValueError):
    """A row of one part of a BEIR upload (``file``: the qrels, ``corpus``, ``queries``) is bad."""

    part: str
    error: DatasetError

    def __str__(self) -> str:
        return f"{self.part}: {self.error}"


def _beir_jsonl(data: bytes, part: str, key: str) -> Iterator[tuple[int, BeirDoc | BeirQuery | BeirQrel]]:
    """BEIR's corpus.jsonl (``_id``, ``title``?, ``text``) or queries.jsonl (``_id``, ``text``)
    rows as this module's beir rows (``corpus_id`` / ``query_id``), each checked like them."""
    try:
        lines = list(iter_lines(data))
    except DatasetError as exc:
        raise BeirPartError(part, exc) from None
    for number, raw in lines:
        try:
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"malformed JSON ({exc.msg} at column {exc.colno})", line=number) from None
            if not isinstance(row, dict):
                raise DatasetError(f"each line must be a JSON object, got {type(row).__name__}", line=number)
            if "_id" not in row:
                raise DatasetError(f"field '_id' is missing ({part} rows need it)", line=number, field="_id")
            fields = {key: _beir_id(row, "_id", number), "text": row.get("text")}
            if key == "corpus_id":
                fields["title"] = row.get("title")
            rec = _beir_row(fields, number)
        except DatasetError as exc:
            raise BeirPartError(part, exc) from None
        yield number, rec


def beir_upload(qrels: bytes, corpus: bytes, queries: bytes) -> bytes:
    """BEIR's own files (a qrels TSV ``query-id<TAB>corpus-id<TAB>score``, its header line
    optional, with ``corpus.jsonl`` and ``queries.jsonl``) as one ``beir`` JSONL file: every
    document, the queries the qrels name, and the qrels. A bad row raises
    :class:`BeirPartError` naming the part and its line; a qrel naming a query or document the
    other files lack is refused with its qrels line."""
    docs = of_kind([rec for _, rec in _beir_jsonl(corpus, "corpus", "corpus_id")], BeirDoc)
    doc_ids = {r.corpus_id for r in docs}
    query_rows = {
        q.query_id: q for q in of_kind([r for _, r in _beir_jsonl(queries, "queries", "query_id")], BeirQuery)
    }
    try:
        lines = list(iter_lines(qrels))
    except DatasetError as exc:
        raise BeirPartError("file", exc) from None
    rels: list[dict[str, Any]] = []
    for number, raw in lines:
        cols = raw.rstrip("\r").split("\t")

        def bad(message: str, field: str | None = None, line: int = number) -> BeirPartError:
            return BeirPartError("file", DatasetError(message, line=line, field=field))

        if len(cols) != 3:
            raise bad(
                f"a qrels row has 3 tab-separated fields (query-id, corpus-id, score), got {len(cols)}: {raw[:80]!r}"
            )
        qid, cid, score_text = (c.strip() for c in cols)
        try:
            score = float(score_text)
        except ValueError:
            if number == lines[0][0] and not rels:
                continue  # the header line (query-id, corpus-id, score)
            raise bad(f"score {score_text[:40]!r} is not a number", "score") from None
        if not qid or not cid:
            raise bad("query-id and corpus-id must not be empty", "query-id" if not qid else "corpus-id")
        if qid not in query_rows:
            raise bad(f"query-id {qid!r} is not in the queries file", "query-id")
        if cid not in doc_ids:
            raise bad(f"corpus-id {cid!r} is not in the corpus file", "corpus-id")
        rels.append({"query_id": qid, "corpus_id": cid, "score": score})
    if not any(r["score"] > 0 for r in rels):
        raise BeirPartError("file", DatasetError("no qrels row with a score above 0", field="score"))
    named = dict.fromkeys(r["query_id"] for r in rels)
    rows: list[dict[str, Any]] = [{"corpus_id": d.corpus_id, "title": d.title, "text": d.text} for d in docs]
    rows += [{"query_id": q, "text": query_rows[q].text} for q in named]
    rows += rels
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)


def check_kind(record: Record, kind: Kind) -> None:
    if kind == "sft":
        msgs = record.messages if isinstance(record, ChatRecord) else []
        if not any(m["role"] == "assistant" for m in msgs):
            raise DatasetError("no assistant message to learn from", line=record.line, field="messages")


def iter_lines(data: bytes) -> Iterator[tuple[int, str]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DatasetError("not valid UTF-8", line=line) from None
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            yield number, raw


def parse_dataset(
    data: bytes | Iterable[tuple[int, str]], *, max_rows: int | None = None, kind: Kind | None = None
) -> ParsedDataset:
    """Parse and validate a whole JSONL file. Raises ``DatasetError`` naming up to five bad lines."""
    lines = iter_lines(data) if isinstance(data, bytes) else iter(data)
    fmt: str | None = None
    records: list[Record] = []
    errors: list[DatasetError] = []
    for number, raw in lines:
        try:
            row = json.loads(raw)
            problem = jsonsafe.find_problem(row)
        except json.JSONDecodeError as exc:
            errors.append(DatasetError(f"malformed JSON ({exc.msg} at column {exc.colno})", line=number))
        except RecursionError:
            errors.append(DatasetError(f"nested deeper than {jsonsafe.MAX_DEPTH} levels", line=number))
        else:
            if problem is not None:
                # Too deep, or NaN/Infinity: the row is refused before anything walks it recursively.
                path, message, _code = problem
                where = ".".join(str(p) for p in path[:4]) + ("..." if len(path) > 4 else "")
                errors.append(DatasetError(message, line=number, field=where or None))
                continue
            try:
                if not isinstance(row, dict):
                    raise DatasetError(
                        f"each line must be a JSON object, got {type(row).__name__}", line=number
                    )
                if fmt is None:
                    fmt = detect_format(row)
                    if fmt is None:
                        raise DatasetError(
                            "unrecognised row: expected one of the fields messages, conversations, instruction/output, "
                            f"prompt/completion, question/answer, prompt/chosen/rejected, prompt/completion/label, chosen/rejected, "
                            f"query/positive, corpus_id/query_id, question/sentence/label (got {sorted(row)})",
                            line=number,
                        )
                    if kind is not None and kind not in FORMAT_KINDS[fmt]:
                        raise DatasetError(
                            f"{fmt} rows cannot be used for {kind} (they suit {', '.join(FORMAT_KINDS[fmt])})",
                            line=number,
                        )
                rec = normalise_row(fmt, row, number)
                if kind is not None:
                    check_kind(rec, kind)
                records.append(rec)
            except DatasetError as exc:
                errors.append(exc)
        if len(errors) >= MAX_ERRORS:
            break
        if max_rows is not None and len(records) > max_rows:
            raise DatasetError(f"more than {max_rows} rows")
    if errors:
        first = errors[0]
        message = "; ".join(str(e) for e in errors)
        raise DatasetError(message, line=first.line, field=first.field) from None
    if fmt is None or not records:
        raise DatasetError("the file is empty (no JSON lines)")
    if fmt == "beir":
        check_beir(records)
    return ParsedDataset(fmt, FORMAT_KINDS[fmt], records)


def records_for(parsed: ParsedDataset, kind: Kind) -> list[Record]:
    if kind not in parsed.kinds:
        raise DatasetError(
            f"a {parsed.format} dataset cannot be used for {kind} (it suits {', '.join(parsed.kinds)})"
        )
    for rec in parsed.records:
        check_kind(rec, kind)
    return parsed.records
