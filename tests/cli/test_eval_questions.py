"""Question sets over real documents: the file format, the judging of one answer, the totals,
the shipped sets, and ``tandem eval rag --questions`` on bad input (no documents needed)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli.eval_questions import (
    Question,
    QuestionSetError,
    abstains,
    has_phrase,
    judge,
    load_questions,
    locates,
    parse_questions,
    ratios,
    source_matches,
    states,
    summary,
)

SETS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "answers" / "sets"


def _line(**fields: object) -> str:
    return json.dumps(fields)


GOOD = _line(id="a", question="Which option?", answers=["--deep-scan"], source="guide.html")
UNANSWERABLE = _line(id="u", question="What does it cost?", answerable=False)


# -- the format ---------------------------------------------------------------------------------


def test_a_set_parses_skipping_blank_and_comment_lines() -> None:
    qs = parse_questions(["# a comment", GOOD, "", UNANSWERABLE])
    assert [q.id for q in qs] == ["a", "u"]
    assert qs[0].answers == ["--deep-scan"] and qs[0].answerable
    assert not qs[1].answerable and qs[1].source is None


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ('{"id": "b", "question": ', "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (_line(id="b", question="Q?", source="x.md"), "needs answers (key phrases) or a reference"),
        (_line(id="b", question="Q?", answers=["x"]), "needs the source"),
        (_line(id="b", question="Q?", answers=["x"], answerable=False), "has no answers, reference"),
        (
            _line(id="b", question="Q?", also_in=["y.md"], answerable=False),
            "has no answers, reference or also_in",
        ),
        (_line(id="b", question="Q?", answers=[" "], source="x.md"), "at least one non-blank key phrase"),
        (_line(id="b", question="Q?", answers=["x"], source="x.md", page=0), "page"),
        (_line(id="b", question="Q?", answers=["x"], source="x.md", colour="red"), "colour"),
        (_line(id="a", question="Again?", answers=["x"], source="x.md"), "id 'a' already used on line 1"),
    ],
)
def test_a_malformed_line_is_refused_naming_its_line(bad: str, says: str) -> None:
    with pytest.raises(QuestionSetError) as err:
        parse_questions([GOOD, "", bad], "set.jsonl")
    assert err.value.line == 3
    assert str(err.value).startswith("set.jsonl line 3: ")
    assert says in str(err.value)


def test_an_empty_or_unreadable_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n# nothing\n")
    with pytest.raises(QuestionSetError, match="no questions"):
        load_questions(tmp_path / "empty.jsonl")
    with pytest.raises(QuestionSetError, match="cannot read it"):
        load_questions(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("name", ["tandem-docs", "valgrind-html", "libtasn1-pdf", "sqlite-html"])
def test_each_shipped_set_has_thirty_questions_a_fifth_unanswerable(name: str) -> None:
    qs = load_questions(SETS_DIR / f"{name}.jsonl")
    assert len(qs) >= 30
    assert sum(not q.answerable for q in qs) >= len(qs) / 5
    assert all(q.source for q in qs if q.answerable)
    if name == "libtasn1-pdf":  # a PDF: every answerable question names its page
        assert all(q.page for q in qs if q.answerable)


# -- judging one answer -------------------------------------------------------------------------


def test_key_phrases_match_whole_words_ignoring_case_and_underscores() -> None:
    assert has_phrase("Use the --check option [1].", "--check")
    assert not has_phrase("It checks the syntax.", "--check")
    assert has_phrase("It returns QUOR BUF SHORT.", "QUOR_BUF_SHORT")  # PDF text loses underscores
    assert has_phrase("it returns -1 on a missing key", "-1")
    assert not has_phrase("it returns -10", "-1")
    assert not has_phrase("ioctl", "io")
    assert has_phrase("The \u201cprobably ok\u201d case", '"probably ok"')


def test_an_answer_states_a_key_phrase_or_most_of_a_reference() -> None:
    by_phrase = Question(id="a", question="Q?", answers=["Brightwell", "Brightwel"], source="faq.html")
    assert states("It was called Brightwel.", by_phrase)
    assert not states("It was called Ashford.", by_phrase)
    ref = Question(
        id="r",
        question="Can Ferrule resume a copy that was interrupted?",
        reference="No: Ferrule has to start every copy again from the first file.",
        source="faq.html",
    )
    assert states("No, it starts again from the first file.", ref)
    assert not states("Yes, it can.", ref)


@pytest.mark.parametrize(
    "text",
    [
        "I don't know.",
        "The sources do not say how much it costs.",
        "There is no information about the price in the context.",
        "I cannot find that in the documents.",
        "The price is not mentioned.",
        "",
    ],
)
def test_abstentions_are_recognised(text: str) -> None:
    assert abstains(text)


def test_an_answer_is_not_an_abstention_and_answer_kind_not_found_is_one() -> None:
    assert not abstains("Use --deep-scan=yes to turn on the duplicate finder.")
    assert abstains("Some text.", "not_found")


@pytest.mark.parametrize(
    ("expected", "cite", "match"),
    [
        ("docs/operations.md", {"document_id": "docs-operations.md"}, True),
        ("docs/operations.md", {"document_id": "operations.md"}, True),
        ("faq.html", {"document_id": "faq.html"}, True),
        ("faq.html", {"document_id": "x", "metadata": {"source": "ferrule/faq.html"}}, True),
        ("libquor.pdf", {"document_id": "libquor.pdf", "title": "Libquor"}, True),
        ("faq.html", {"document_id": "guide.html"}, False),
        ("docs/operations.md", {"document_id": "docs-operations-extra.md"}, False),
    ],
)
def test_a_source_matches_by_id_title_or_metadata(expected: str, cite: dict, match: bool) -> None:
    assert source_matches(expected, cite) is match


def test_a_citation_locates_a_page_or_section_or_cannot_tell() -> None:
    q = Question(id="p", question="Q?", answers=["x"], source="a.pdf", page=22, section="Tree functions")
    assert locates(q, {"pages": [21, 22]}) is True
    assert locates(q, {"page": 22}) is True
    assert locates(q, {"page_start": 20, "page_end": 23}) is True
    assert locates(q, {"pages": [3]}) is False
    assert locates(q, {"section": "Libquor > 4 Function reference > 4.3 Tree functions"}) is True
    assert locates(q, {"headings": ["Libquor", "4.3 Tree functions"]}) is True
    assert locates(q, {"section": "Introduction"}) is False
    assert locates(q, {"document_id": "a.pdf"}) is None  # today's citations: neither field
    assert locates(Question(id="n", question="Q?", answers=["x"], source="a.md"), {"page": 1}) is None


def _out(answer: str, citations: list[dict], **done: object) -> dict:
    return {"answer": answer, "done": {"citations": citations, **done}, "first": 0.5, "total": 2.0}


DOCS = ["Quick is the default mode. The --deep-scan option turns on the thorough duplicate file finder."]


def test_judge_reads_answer_kind_page_and_section_when_responses_carry_them() -> None:
    q = Question(
        id="a",
        question="Which option turns on the duplicate finder?",
        answers=["--deep-scan"],
        source="qs.html",
        section="Running",
    )
    cite = {"document_id": "qs.html", "section": "Guide > 3. Running your program", "kind": "cited"}
    o = judge(
        q,
        _out(
            "The --deep-scan option turns on the thorough duplicate file finder [1].",
            [cite],
            answer_kind="generated",
        ),
        DOCS,
    )
    assert (o.stated, o.right_source, o.right_place, o.abstained, o.answer_kind) == (
        True,
        True,
        True,
        False,
        "generated",
    )
    assert o.groundedness == 1.0
    wrong = judge(q, _out("Use ferrule.", [{"document_id": "faq.html"}]), DOCS)
    assert (wrong.stated, wrong.right_source, wrong.right_place) == (False, False, None)


def test_a_citation_of_another_document_stating_the_fact_is_a_right_source() -> None:
    q = Question(
        id="a", question="Which option?", answers=["--deep-scan"], source="qs.html", also_in=["faq.html"]
    )
    assert q.sources == ["qs.html", "faq.html"]
    answer = "Use --deep-scan [1]."
    assert judge(q, _out(answer, [{"document_id": "faq.html"}]), DOCS).right_source is True
    assert judge(q, _out(answer, [{"document_id": "manual.html"}]), DOCS).right_source is False


def test_judge_takes_todays_kind_field_and_infers_an_abstention() -> None:
    q = Question(id="a", question="Which option?", answers=["--deep-scan"], source="qs.html")
    extractive = judge(
        q, _out("The --deep-scan option turns on the finder [1].", [], kind="extractive"), DOCS
    )
    assert extractive.answer_kind == "extractive" and not extractive.abstained
    u = Question(id="u", question="What does Ferrule cost?", answerable=False)
    declined = judge(u, _out("I don't know.", []), DOCS)
    assert declined.abstained and declined.answer_kind == "not_found" and declined.stated is None
    assert declined.groundedness is None
    peerless = judge(q, _out("The --deep-scan option.", []), DOCS, cites_sources=False)
    assert peerless.right_source is None


def test_summary_and_ratios_add_up_per_kind_of_question() -> None:
    yes = Question(
        id="a",
        question="Which option turns on the duplicate finder?",
        answers=["--deep-scan"],
        source="qs.html",
    )
    no = Question(id="u", question="What does Ferrule cost?", answerable=False)
    outcomes = [
        judge(
            yes,
            _out("The --deep-scan option turns on the duplicate finder [1].", [{"document_id": "qs.html"}]),
            DOCS,
        ),
        judge(yes, _out("I don't know.", []), DOCS),
        judge(no, _out("The sources do not say.", [], answer_kind="not_found"), DOCS),
        judge(no, _out("It costs 10 dollars.", []), DOCS),
        judge(yes, {"answer": "", "error": "HTTP 500", "total": 1.0}, DOCS),
    ]
    s = summary(outcomes)
    assert (s["questions"], s["answerable"], s["unanswerable"], s["errors"]) == (5, 3, 2, 1)
    assert s["answer_stated"] == 0.5 and s["false_abstention"] == 0.5
    assert s["right_source_cited"] == 0.5 and s["right_page_or_section_cited"] is None
    assert s["abstained_when_unanswerable"] == 0.5
    assert s["not_found"] == 0.5 and s["generated"] == 0.5
    assert s["total_p50_s"] == 2.0
    other = {**s, "answer_stated": 0.25, "false_abstention": 0.0}
    r = ratios(s, other)
    assert r["answer_stated"] == 2.0 and r["false_abstention"] is None and r["total_p50_s"] == 1.0


# -- the peer's splitter ------------------------------------------------------------------------


def test_the_peer_splitter_keeps_chunks_and_overlaps_in_bounds() -> None:
    from benchmarks.answers.peer import split_text

    words = [f"word{i}" for i in range(900)]
    text = "\n\n".join(" ".join(words[i : i + 60]) + "." for i in range(0, 900, 60))
    chunks = split_text(text, 1000, 200)
    assert len(chunks) > 5 and all(len(c) <= 1000 for c in chunks)
    seen = [w for c in chunks for w in re.findall(r"word\d+", c)]
    assert list(dict.fromkeys(seen)) == words  # every word, in order
    for a, b in itertools.pairwise(chunks):  # neighbours share at most 200 characters
        tail = a[-200:]
        assert any(b.startswith(tail[i:]) for i in range(len(tail))) or not set(a.split()) & set(b.split())
    assert split_text("short text", 1000, 200) == ["short text"]
    assert split_text("x" * 2500, 1000, 200)[0] == "x" * 1000  # no separator: by characters


# -- the command on bad input -------------------------------------------------------------------


def _cli(*args: str) -> tuple[int, str]:
    from services.cli.main import app

    result = CliRunner().invoke(app, ["eval", "rag", *args])
    return result.exit_code, re.sub(r"\s+", " ", result.output)


def test_the_command_names_the_malformed_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n" + '{"id": "x", "question": "Q?", "answers": ["y"]}\n')
    code, out = _cli("--questions", str(path), "--collection", "c", "--api-key", "k")
    assert code == 2
    assert "bad.jsonl line 2: " in out and "needs the source" in out


def test_the_command_wants_a_collection(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(GOOD + "\n")
    code, out = _cli("--questions", str(path), "--api-key", "k")
    assert code == 2 and "--collection" in out


def test_an_unknown_collection_is_named(tmp_path: Path, tandem_env: Path, api_key: str) -> None:
    from services.retrieval.app import create_app
    from tests.helpers.servers import serve_app

    path = tmp_path / "q.jsonl"
    path.write_text(GOOD + "\n")
    with serve_app(create_app()) as url:
        code, out = _cli(
            "--questions", str(path), "--collection", "no-such-docs", "--api-key", api_key,
            "--retrieval-url", url, "--agent-url", url,
        )  # fmt: skip
    assert code == 1
    assert "collection 'no-such-docs' not found (HTTP 404)" in out


def test_a_run_asks_the_unanswerable_questions_spread_among_the_others() -> None:
    from benchmarks.answers.real_documents import spread

    qs = parse_questions([_line(id=f"a{i}", question="Q?", answers=["x"], source="s.md") for i in range(8)])
    qs += parse_questions([_line(id=f"u{i}", question="Q?", answerable=False) for i in range(2)])
    order = "".join("u" if not q.answerable else "a" for q in spread(qs))
    assert order == "aauaaaauaa"
    assert sorted(q.id for q in spread(qs)) == sorted(q.id for q in qs)
