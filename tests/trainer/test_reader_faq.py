"""The reader's FAQ dataset (services/trainer/data/faq.py and ``tandem reader dataset``), on small
FAQ documents written for these tests in the shapes of the packages' POD and HTML."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli.main import app
from services.trainer.data import faq

POD = """\
=head1 NAME

toyfaq4 - Gardening Matters

=head1 DESCRIPTION

This page answers questions about a small garden.

=head1 Soil: Basics

=head2 How do I test the acidity of my soil?

(contributed by A. Gardener)

Use a C<pH> kit from any garden shop. Push the probe into damp soil
and read the dial after a minute.

    probe --depth 5cm --read
    dial.show()

See L<toyfaq5/"Watering"> for moisture. The kit also works in pots.
Readings below 6.0 mean acidic soil.

=head2 Can I compost kitchen scraps?

Yes.

Vegetable peelings, coffee grounds and egg shells compost well.

=head1 Tools

=head2 Which spade should I buy?

Pick a spade with a forged blade and an ash handle:

=over 4

=item * A border spade suits small beds.

=item * A digging spade suits heavy clay.

=back

=head1 AUTHOR AND COPYRIGHT

Written for the tests.
"""

PYTHON_HTML = """\
<html><head><title>Toy FAQ</title></head><body>
<div class="related" role="navigation"><ul><li>index</li></ul></div>
<div class="body" role="main">
<section id="toy-faq">
<h1>Toy Programming FAQ<a class="headerlink" href="#toy-faq">¶</a></h1>
<nav class="contents" id="contents"><ul><li><a href="#q1">How do I reverse a list?</a></li></ul></nav>
<section id="sequences">
<h2>Sequences<a class="headerlink" href="#sequences">¶</a></h2>
<section id="q1">
<h3>How do I reverse a list?<a class="headerlink" href="#q1">¶</a></h3>
<p>Call the <code class="docutils literal"><span class="pre">list.reverse()</span></code> method
of the list, e.g. on a copy. It works in place.</p>
<div class="highlight-python3 notranslate"><div class="highlight"><pre>items.reverse()
print(items)</pre></div></div>
<p>Use <code class="docutils literal">reversed(x). Not</code> that one if you need a new list.
Python 3.11 keeps both.</p>
</section>
<section id="q2">
<h3>Why is my tuple immutable?<a class="headerlink" href="#q2">¶</a></h3>
<p>Tuples are fixed by design so that they can be dictionary keys.</p>
<ul><li><p>Lists change.</p></li><li><p>Tuples do not change after creation.</p></li></ul>
</section>
</section>
</section>
</div>
<div class="footer">Copyright the tests.</div>
</body></html>
"""

DEBIAN_HTML = """\
<html><body><div class="navheader"><table><tr><td>Prev</td></tr></table></div>
<div class="chapter"><div class="titlepage"><h1 class="title">Chapter 3. Toy packages</h1></div>
<div class="toc"><dl class="toc"><dt>3.1. What is a toy package?</dt></dl></div>
<div class="section"><h2 class="title">3.1. What is a toy package?</h2>
<p>A toy package bundles the files of one toy.<a class="footnote" href="#f1"><sup class="footnote">[1]</sup></a>
Toys are installed with <code class="literal">toy-get --install</code> on any machine.</p>
<div class="footnotes"><div class="footnote"><p>[1] A footnote that is no answer.</p></div></div>
</div></div></body></html>
"""

GIT_HTML = """\
<html><body><div id="header"><h1>toyfaq(7) Manual Page</h1></div>
<div id="content"><div class="sect1"><h2 id="_config">Configuration</h2>
<div class="sectionbody"><div class="dlist"><dl>
<dt class="hdlist1">What should I put in <code>toy.name</code>?</dt>
<dd><p>Your own name, as you sign letters.</p>
<div class="paragraph"><p>It is stored in every toy you make.</p></div></dd>
<dt class="hdlist1">I renamed my toy and the old name still shows</dt>
<dd><p>Run the rename command again with the <code>--force</code> option.</p></dd>
</dl></div></div></div></div></body></html>
"""


def by_question(entries: list[faq.FaqEntry]) -> dict[str, faq.FaqEntry]:
    return {e.question: e for e in entries}


def test_pod_entries_have_questions_context_and_no_code() -> None:
    entries = by_question(faq.entries_from_flow(faq.pod_flow(POD), "toy-doc", "toyfaq4"))
    assert list(entries) == [
        "How do I test the acidity of my soil?",
        "Can I compost kitchen scraps?",
        "Which spade should I buy?",
    ]
    soil = entries["How do I test the acidity of my soil?"]
    assert soil.context == "toyfaq4 - Gardening Matters > Soil: Basics"
    assert entries["Which spade should I buy?"].context == "toyfaq4 - Gardening Matters > Tools"
    assert soil.sentences == (
        "Use a pH kit from any garden shop.",
        "Push the probe into damp soil and read the dial after a minute.",
        'See "Watering" in toyfaq5 for moisture.',
        "The kit also works in pots.",
        "Readings below 6.0 mean acidic soil.",
    )
    text = " ".join(soil.answer_paragraphs)
    assert "probe --depth" not in text and "dial.show()" not in text  # the verbatim block is code
    assert "contributed by" not in text  # an aside, not the answer
    # list items are sentences of their own; the standard POD sections hold no entries
    assert entries["Which spade should I buy?"].sentences[1:] == (
        "A border spade suits small beds.",
        "A digging spade suits heavy clay.",
    )
    assert all(e.group == "toyfaq4" and e.source == "toy-doc" for e in entries.values())


def test_html_entries_skip_navigation_code_and_footnotes() -> None:
    entries = by_question(faq.entries_from_flow(faq.html_flow(PYTHON_HTML), "toy-doc", "toy-faq/p"))
    assert list(entries) == ["How do I reverse a list?", "Why is my tuple immutable?"]
    rev = entries["How do I reverse a list?"]
    assert rev.context == "Toy Programming FAQ > Sequences"
    assert rev.sentences == (
        "Call the list.reverse() method of the list, e.g. on a copy.",
        "It works in place.",
        "Use reversed(x). Not that one if you need a new list.",  # inline code is never split
        "Python 3.11 keeps both.",
    )
    assert "items.reverse()" not in " ".join(rev.answer_paragraphs)
    assert entries["Why is my tuple immutable?"].sentences[1:] == (
        "Lists change.",
        "Tuples do not change after creation.",
    )
    [toy] = faq.entries_from_flow(faq.html_flow(DEBIAN_HTML), "debian-toy", "debian-toy")
    assert (toy.question, toy.context) == ("What is a toy package?", "Toy packages")  # numbers dropped
    assert toy.sentences == (
        "A toy package bundles the files of one toy.",
        "Toys are installed with toy-get --install on any machine.",
    )


def test_definition_terms_that_ask_are_questions() -> None:
    entries = faq.entries_from_flow(faq.html_flow(GIT_HTML), "git-toy", "toyfaq")
    assert [(e.question, e.context) for e in entries] == [
        ("What should I put in toy.name?", "toyfaq(7) Manual Page > Configuration"),
        ("I renamed my toy and the old name still shows", "toyfaq(7) Manual Page > Configuration"),
    ]
    assert entries[0].sentences == (
        "Your own name, as you sign letters.",
        "It is stored in every toy you make.",
    )
    assert entries[1].sentences == ("Run the rename command again with the --force option.",)


@pytest.mark.parametrize(
    ("paragraph", "sentences"),
    [
        ("Perl 5.004 added it. Use --foo too.", ["Perl 5.004 added it.", "Use --foo too."]),
        ("Ask A. U. Thor, i.e. the author. He knows.", ["Ask A. U. Thor, i.e. the author.", "He knows."]),
        ("Really? Yes! It is (see below.) Done.", ["Really?", "Yes!", "It is (see below.)", "Done."]),
        (
            "Files end in .deb and list.sort() sorts. ok then",
            ["Files end in .deb and list.sort() sorts. ok then"],
        ),
    ],
)
def test_sentence_splitting(paragraph: str, sentences: list[str]) -> None:
    assert faq.split_sentences(paragraph) == sentences


def entry(question: str, *sentences: str, group: str = "g") -> faq.FaqEntry:
    return faq.FaqEntry(question, (" ".join(sentences),), "Ctx", "src", group, sentences)


def test_positive_rule() -> None:
    long = "The garden hose reaches every bed in the yard easily."
    assert faq.positives(entry("Does it reach?", long, "More words follow here now.")) == [long]
    # short, introducing, restating first sentences bring the second along
    assert len(faq.positives(entry("Does it reach?", "Yes.", long))) == 2
    assert len(faq.positives(entry("How do I water?", "Water the beds with this simple routine:", long))) == 2
    restating = "Watering tomato plants in dry summer weather is a question."
    assert (
        len(faq.positives(entry("How do I water tomato plants in dry summer weather?", restating, long))) == 2
    )
    assert faq.positives(entry("Q?", "Only one sentence answers this question here.")) == [
        "Only one sentence answers this question here."
    ]


def corpus() -> list[faq.FaqEntry]:
    return [
        entry(
            "How do I prune roses in winter?",
            "Cut rose stems just above an outward bud with sharp shears.",
            "Remove dead wood first.",
            "Burn or bin the cuttings afterwards.",
            "Winter pruning keeps roses compact and healthy for spring.",
            "Wear thick gloves because rose thorns are sharp.",
            "Old roses may need only a light trim.",
            group="roses",
        ),
        entry(
            "When should I water tomatoes?",
            "Water tomatoes early in the morning at the roots.",
            "Evening watering invites mildew on the leaves of tomatoes.",
            group="veg",
        ),
        entry(
            "Which roses grow in shade?",
            "Rambling roses tolerate some shade better than hybrid teas in winter.",
            "Pruning roses in shade needs less effort than in full sun.",
            group="roses",
        ),
        entry(
            "How do I store seeds?",
            "Keep seeds dry and cool in paper envelopes labelled with the year.",
            "Sharp frosts do not harm stored seeds kept indoors in winter.",
            group="seeds",
        ),
    ]


def test_rows_labels_groups_and_negatives() -> None:
    rows = faq.reader_rows(corpus(), seed=3)
    prune = [r for r in rows if r.question == "How do I prune roses in winter?"]
    assert [r.sentence for r in prune if r.label == 1] == [
        "Cut rose stems just above an outward bud with sharp shears."
    ]
    negatives = [r.sentence for r in prune if r.label == 0]
    own = corpus()[0].sentences
    # the sentences of other entries that share most of the question's words come first
    assert negatives[0] == "Rambling roses tolerate some shade better than hybrid teas in winter."
    others = [s for s in negatives if s not in own]
    assert 3 <= len(others) <= faq.HARD_NEGATIVES + 1
    tail = [s for s in negatives if s in own]
    assert len(tail) == 2 and all(own.index(s) >= faq.TAIL_FROM for s in tail)
    assert all(faq.words(s) >= faq.NEGATIVE_MIN_WORDS for s in negatives)
    assert {r.group for r in prune} == {"roses"}
    assert {(r.question, r.group) for r in rows} == {(e.question, e.group) for e in corpus()}
    keys = [(r.group, r.context, r.question, r.sentence) for r in rows]
    assert len(keys) == len(set(keys))
    line = json.loads(prune[0].to_json())
    assert list(line) == ["question", "sentence", "context", "label", "source", "group"]
    assert line["label"] == 1


def test_rows_are_deterministic() -> None:
    assert faq.reader_rows(corpus(), seed=3) == faq.reader_rows(list(corpus()), seed=3)


def test_dedupe_keeps_the_positive() -> None:
    row = faq.ReaderRow("q", "s", "c", 0, "src", "g")
    assert faq.dedupe([row, faq.ReaderRow("q", "s", "c", 1, "src", "g"), row]) == [
        faq.ReaderRow("q", "s", "c", 1, "src", "g")
    ]


def toy_docs(root: Path) -> Path:
    """A docs folder in the layout of the four packages, holding the documents above."""
    files = {
        "perl-doc/usr/share/perl/5.36.0/pod/perlfaq4.pod": POD,
        "python3.11-doc/usr/share/doc/python3.11/html/faq/programming.html": PYTHON_HTML,
        "debian-faq/usr/share/doc/debian/FAQ/toys.en.html": DEBIAN_HTML,
        "git-doc/usr/share/doc/git-doc/gitfaq.html": GIT_HTML,
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    # Debian's link of every chapter, read once
    (root / "debian-faq/usr/share/doc/debian/FAQ/toys.html").symlink_to("toys.en.html")
    return root


def test_build_groups_and_byte_identical_gzip(tmp_path: Path) -> None:
    docs = toy_docs(tmp_path / "docs")
    first, second = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    line = faq.build(docs, first)
    faq.build(docs, second)
    assert first.read_bytes() == second.read_bytes()
    rows = [json.loads(x) for x in gzip.decompress(first.read_bytes()).decode().splitlines()]
    assert {r["group"] for r in rows} == {"perlfaq4", "python-faq/programming", "debian-faq", "gitfaq"}
    assert {r["source"] for r in rows} == set(faq.PACKAGES)
    assert sum(r["question"] == "What is a toy package?" and r["label"] == 1 for r in rows) == 1
    assert line.startswith("reader dataset: perl-doc 3 entries/") and "positive" in line


def test_cli_writes_rows_and_summary(tmp_path: Path) -> None:
    docs = toy_docs(tmp_path / "docs")
    result = CliRunner().invoke(app, ["reader", "dataset", "--docs", str(docs)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in result.stdout.splitlines()]
    assert rows and all(
        set(r) == {"question", "sentence", "context", "label", "source", "group"} for r in rows
    )
    assert "reader dataset:" in result.stderr


def test_cli_refuses_missing_docs(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["reader", "dataset", "--docs", str(tmp_path / "nowhere")])
    assert result.exit_code != 0
    assert "perl-doc" in result.stderr and "no such directory" in result.stderr
    assert "python -m benchmarks.answers.fetch" in result.stderr
    docs = toy_docs(tmp_path / "docs")
    (docs / "git-doc/usr/share/doc/git-doc/gitfaq.html").unlink()
    result = CliRunner().invoke(app, ["reader", "dataset", "--docs", str(docs)])
    assert result.exit_code != 0
    assert "git-doc missing" in result.stderr and "perl-doc" not in result.stderr.split("fetch")[0]
