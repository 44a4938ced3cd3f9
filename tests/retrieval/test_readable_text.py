"""Text as people read it: PDF words hyphenated at line ends joined (compounds kept), ligatures
and soft hyphens fixed with quotes and code left alone, HTML definition lists one item a block."""

from __future__ import annotations

import io
import os

from services.common.chunking import regex_offsets
from services.retrieval.core.chunking import make_chunks
from services.retrieval.core.parsing import parse_file
from services.retrieval.core.text_cleanup import fix_characters, join_hyphenated

# (font, lines) of each page of ``relay_pdf``; "Vera" is reportlab's TrueType font, which has
# the ﬁ and ﬂ ligatures and the soft hyphen.
RELAY_PAGES = [
    [
        ("Vera", "The relay daemon can be manip-"),
        ("Vera", "ulated through its control socket."),
        ("Vera", "Pass the command-"),
        ("Vera", "line flags before the file name."),
        ("Vera", "Every command-line flag has a long form."),
        ("Vera", "It starts the X-"),
        ("Vera", "Window session on display zero."),
        ("Vera", "Changes need a recon-"),
        ("Vera", "figuration of the relay."),
        ("Vera", "A reconfiguration takes one second."),
        ("Vera", "Hashing is a time-"),
        ("Vera", "consuming step for large inputs."),
        ("Vera", "Consuming less time is the goal."),
        ("Vera", "The \ufb01le is \ufb02ushed to a water\u00ad"),
        ("Vera", "proof disk. Proof of water damage is kept."),
        ("Vera", "Raise the verbosity like this:"),
        ("Courier", "  relay --verb-"),
        ("Courier", "  osity 2"),
        ("Vera", "Logs are written to the rotat-"),
    ],
    [
        ("Vera", "ing journal every hour."),
        ("Vera", "Quotes stay \u201ccurly\u201d and the ellipsis\u2026 stays."),
    ],
]
RELAY_HEADING = "Relay Settings"


def relay_pdf() -> bytes:
    """Two A4 pages: a 16 pt heading, then 11 pt lines as ``RELAY_PAGES`` has them."""
    import reportlab
    from reportlab.lib.pagesizes import A4
    from reportlab.pdfbase import pdfmetrics
    from reportlab.pdfbase.ttfonts import TTFont
    from reportlab.pdfgen import canvas

    fonts = os.path.join(os.path.dirname(reportlab.__file__), "fonts")
    pdfmetrics.registerFont(TTFont("Vera", os.path.join(fonts, "Vera.ttf")))
    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=A4)
    for n, lines in enumerate(RELAY_PAGES):
        y = 780.0
        if n == 0:
            c.setFont("Helvetica-Bold", 16)
            c.drawString(72, y, RELAY_HEADING)
            y -= 28
        for font, line in lines:
            c.setFont(font, 11)
            c.drawString(72, y, line)
            y -= 16
        c.showPage()
    c.save()
    return buf.getvalue()


def test_pdf_words_hyphenated_at_line_ends_are_joined_and_compounds_kept() -> None:
    doc = parse_file("relay.pdf", relay_pdf())[0]
    text = doc.text
    # a word the typesetter broke: joined, the line break moves after it
    assert "The relay daemon can be manipulated\nthrough its control socket." in text
    # the joined form is the document's own spelling elsewhere
    assert "Changes need a reconfiguration\nof the relay." in text
    # compounds keep their hyphen: written so elsewhere, a capital, two words of their own
    assert "Pass the command-\nline flags" in text
    assert "It starts the X-\nWindow session" in text
    assert "Hashing is a time-\nconsuming step" in text
    # a soft hyphen at a line end always breaks a word, and never shows
    assert "flushed to a waterproof\ndisk." in text and "\u00ad" not in text
    # code (monospaced type) is never joined, though prose spells "verbosity"
    assert "relay --verb-\n  osity 2" in text
    assert "manip-" not in text and "recon-" not in text
    # headings and pages as before
    assert text.startswith(f"# {RELAY_HEADING}\n")
    assert [p for p, _ in doc.structure["pages"]] == [1, 2]


def test_a_word_broken_across_pages_joins_on_the_page_it_starts() -> None:
    doc = parse_file("relay.pdf", relay_pdf())[0]
    page2 = dict(doc.structure["pages"])[2]
    assert doc.text.index("Logs are written to the rotating") < page2
    assert doc.text[page2:].startswith("journal every hour.")
    chunks = make_chunks(doc.id, doc.text, size=4096, overlap=0, structure=doc.structure)
    assert chunks[0].structure["pages"] == [1, 2] and chunks[0].structure["page_starts"][1] == page2


def test_ligatures_become_letters_and_quotes_stay() -> None:
    doc = parse_file("relay.pdf", relay_pdf())[0]
    assert "The file is flushed" in doc.text and "\ufb01" not in doc.text and "\ufb02" not in doc.text
    assert "Quotes stay \u201ccurly\u201d and the ellipsis\u2026 stays." in doc.text
    # only the listed characters change: no NFKC of quotes, ellipses, superscripts, full width
    kept = "\u201cq\u201d \u2018s\u2019 \u2026 x\u00b2 \uff21\uff22 \u00bd"
    assert (
        fix_characters(f"o\ufb00 \ufb03x \ufb04y \ufb05 \ufb06 so\u00adft {kept}")
        == f"off ffix ffly st st soft {kept}"
    )
    # code blocks are left as they are
    md = "The \ufb01rst step.\n\n```\nprint('\ufb01\u00ad')\n```\n".encode()
    assert parse_file("a.md", md)[0].text == "The first step.\n\n```\nprint('\ufb01\u00ad')\n```"
    assert parse_file("a.txt", "e\ufb03cient\n".encode())[0].text == "efficient"


def test_join_hyphenated_rules() -> None:
    # no evidence: plain lower-case pieces join; the rest of the line stays where it was
    assert join_hyphenated(["a manip-\nulated, b"]) == ["a manipulated,\nb"]
    # a line left empty by the move goes
    assert join_hyphenated(["a manip-\nulated\nb"]) == ["a manipulated\nb"]
    # one letter, a capital inside, a digit: kept
    assert join_hyphenated(["the x-\naxis"]) == ["the x-\naxis"]
    assert join_hyphenated(["a GNU-\nstyle flag"]) == ["a GNU-\nstyle flag"]
    assert join_hyphenated(["the x86-\nbased box"]) == ["the x86-\nbased box"]
    # a capitalised first word joins like any other; a capitalised rest does not
    assert join_hyphenated(["Manip-\nulated"]) == ["Manipulated"]
    assert join_hyphenated(["the X-\nWindow"]) == ["the X-\nWindow"]
    # evidence beats the rule, both ways
    assert join_hyphenated(["the X-\nWindow and XWindow"])[0].startswith("the XWindow\nand")
    assert join_hyphenated(["a non-\nzero value, not non-zero"])[0].startswith("a non-\nzero")
    assert join_hyphenated(["a non-\nzero value, not nonzero"])[0].startswith("a nonzero\nvalue")
    # a paragraph break is no line end of a word; and ``keep`` vetoes a break
    assert join_hyphenated(["a manip-\n\nulated"]) == ["a manip-\n\nulated"]
    assert join_hyphenated(["a manip-\nulated"], lambda _p, _line, word: word == "manip-") == [
        "a manip-\nulated"
    ]


RELAY_HTML = """<html><head><title>Relay</title></head><body>
<h1 id="relay">Relay manual<a class="headerlink" href="#relay" title="Permalink">\u00b6</a></h1>
<p>The relay forwards messages
between   queues.</p>
<h2 id="options">Options</h2>
<dl>
<dt><code>listen_port</code></dt>
<dd><p>The TCP port the relay
accepts connections on.</p><p>Default: 8080</p></dd>
<dt><code>-q</code></dt><dt><code>--quiet</code></dt>
<dd>Print nothing but errors.</dd>
<dt><code>spool_dir</code></dt>
<dd><p>Where messages wait until a worker is free.</p><p>Default: /var/spool/relay</p></dd>
<dt><code>max_hops</code></dt>
<dd><p>How often one message may be forwarded before it is dropped.</p><p>Default: 12</p></dd>
</dl>
<h2 id="api">API</h2>
<dl class="py function">
<dt class="sig sig-object py" id="relay.open"><span class="sig-prename descclassname"><span class="pre">relay.</span></span><span class="sig-name descname"><span class="pre">open</span></span><span class="sig-paren">(</span><em class="sig-param"><span class="n"><span class="pre">path</span></span></em>, <em class="sig-param"><span class="n"><span class="pre">timeout</span></span><span class="o"><span class="pre">=</span></span><span class="default_value"><span class="pre">30</span></span></em><span class="sig-paren">)</span><a class="headerlink" href="#relay.open" title="Permalink to this definition">\u00b6</a></dt>
<dd><p>Open a relay channel on <em>path</em>.</p>
<dl class="field-list simple">
<dt class="field-odd">Parameters<span class="colon">:</span></dt>
<dd class="field-odd"><ul class="simple">
<li><p><strong>path</strong> \u2013 Where the socket lives.</p></li>
<li><p><strong>timeout</strong> \u2013 Seconds to wait. Default: 30.</p></li>
</ul></dd>
<dt class="field-even">Returns<span class="colon">:</span></dt>
<dd class="field-even"><p>A channel object.</p></dd>
</dl>
</dd></dl>
<h2 id="settings">Settings</h2>
<div class="variablelist"><dl class="variablelist">
<dt id="GUC-RELAY-WORKERS"><span class="term"><code class="varname">relay_workers</code> (<code class="type">integer</code>)
      <a id="id-1.2.3" class="indexterm"></a>
      </span></dt><dd><p>
        Sets how many worker processes the relay
        starts. The default is four.
       </p><p>
        This parameter can only be set at start.
       </p></dd>
<dt><span class="term"><code class="option">--spool=<em class="replaceable"><code>dir</code></em> [default: /var/spool/relay] </code></span></dt>
<dd><p>Where queued messages wait.</p></dd>
</dl></div>
<dl class="namedconf statement">
<dt class="sig sig-object namedconf" id="namedconf-statement-relay-port"><span class="sig-name descname"><span class="pre">relay-port</span></span><a class="headerlink" href="#namedconf-statement-relay-port" title="Permalink to this definition"></a></dt>
<dd><p><strong>Grammar: </strong><div class="highlight"><pre><span></span>relay-port &lt;integer&gt;;   // one per server
</pre></div></p>
<p><strong>Blocks: </strong>options</p>
<p>Sets the port of the relay. The default is 853.</p>
</dd></dl>
<div class="toc"><dl class="toc"><dt><span class="sect1"><a href="#setup">1. Setup</a></span></dt>
<dd><dl><dt><a href="#install">1.1. Install</a></dt><dt><a href="#upgrade">1.2. Upgrade</a></dt></dl></dd>
<dt><a href="#usage">2. Usage</a></dt></dl></div>
</body></html>"""


def test_html_definition_lists_are_one_block_per_item() -> None:
    doc = parse_file("relay.html", RELAY_HTML.encode())[0]
    text = doc.text
    # term: definition on one line; the definition's further paragraphs on the next lines
    assert "\n\nlisten_port: The TCP port the relay accepts connections on.\nDefault: 8080\n\n" in text
    assert "\n\n-q, --quiet: Print nothing but errors.\n\n" in text
    # Sphinx: the signature is the term, its fields lines of the same block, no "¶"
    assert (
        "\n\nrelay.open(path, timeout=30): Open a relay channel on path.\n"
        "Parameters: path \u2013 Where the socket lives.\n"
        "timeout \u2013 Seconds to wait. Default: 30.\n"
        "Returns: A channel object.\n\n"
    ) in text
    assert "\u00b6" not in text and "# Relay manual\n" in text
    # DocBook's variablelist: source line breaks and the index anchor do not split the item
    assert (
        "\n\nrelay_workers (integer): Sets how many worker processes the relay starts. The default is four.\n"
        "This parameter can only be set at start.\n\n"
    ) in text
    assert "--spool=dir [default: /var/spool/relay]: Where queued messages wait." in text
    # a definition holding code: the code fenced on its own lines, inside the item
    assert (
        "relay-port: Grammar:\n```\nrelay-port <integer>;   // one per server\n```\n"
        "Blocks: options\nSets the port of the relay. The default is 853."
    ) in text
    # a table of contents (a term whose definition is a nested list) stays a list of entries
    assert "\n\n1. Setup\n\n1.1. Install\n1.2. Upgrade\n\n2. Usage" in text
    assert "The relay forwards messages between queues." in text


def test_a_parameter_and_its_default_share_a_chunk() -> None:
    doc = parse_file("relay.html", RELAY_HTML.encode())[0]
    items = [
        "listen_port: The TCP port the relay accepts connections on.\nDefault: 8080",
        "spool_dir: Where messages wait until a worker is free.\nDefault: /var/spool/relay",
        "max_hops: How often one message may be forwarded before it is dropped.\nDefault: 12",
        "relay_workers (integer): Sets how many worker processes the relay starts. The default is four.",
    ]
    # Items shorter than half a chunk are never cut: the chunker cuts at the last blank line in
    # the second half of a window, and there is one between two items.
    for overlap in (0, 4):
        chunks = make_chunks(doc.id, doc.text, size=32, overlap=overlap, offsets=regex_offsets)
        for item in items:
            assert any(item in c.text for c in chunks), (overlap, item, [c.text for c in chunks])
            if overlap == 0:
                start = doc.text.index(item)
                assert not any(start < c.start < start + len(item) for c in chunks), item
    chunks = make_chunks(doc.id, doc.text, size=32, overlap=0, offsets=regex_offsets, structure=doc.structure)
    assert {c.structure.get("anchor") for c in chunks if "Default: 8080" in c.text} == {"options"}


def test_html_text_runs_as_a_browser_shows_it() -> None:
    page = (
        "<html><body><h1 id='t'>T\u00adopic</h1><p>An e\ufb03cient\nrelay, \u201cquoted\u201d\u2026 x\u00b2 \uff21.</p>"
        "<pre>keep  \ufb01\n   spacing</pre><p>line one<br>line two</p><dl><dd>An indented note.</dd></dl>"
        "</body></html>"
    )
    doc = parse_file("p.html", page.encode())[0]
    assert doc.text == (
        "# Topic\n\nAn efficient relay, \u201cquoted\u201d\u2026 x\u00b2 \uff21.\n\n"
        "```\nkeep  \ufb01\n   spacing\n```\n\nline one\nline two\n\nAn indented note."
    )
    assert doc.structure["anchors"] == [[0, "t"]]
