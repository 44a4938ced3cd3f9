"""The peer pipeline: LangChain's RAG tutorial chain, on the same documents, embedder and model.

As the tutorial builds it ("Build a Retrieval Augmented Generation (RAG) App"):

- the documents' text (BeautifulSoup's ``get_text`` for HTML, one document per page for a
  PDF as ``PyPDFLoader`` gives it, the file's text for Markdown);
- split with ``RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200)``:
  ``langchain_text_splitters`` is not installed here, so ``split_text`` below is that
  splitter's algorithm (separators ``\\n\\n``, ``\\n``, space, character; each separator kept at
  the start of the piece that follows it; pieces merged up to 1,000 characters with up to 200
  of overlap; whitespace stripped);
- embedded with the collection's embedder (``OpenAIEmbeddings`` pointed at Tandem's inference
  service, all-MiniLM-L6-v2; a chunk past its 256 tokens cut there, as sentence-transformers
  does) into a FAISS flat L2 index (what LangChain's ``FAISS`` store
  builds), retrieved top 4;
- the tutorial's prompt (``rlm/rag-prompt``: "Use the following pieces of retrieved context
  to answer the question. If you don't know the answer, just say that you don't know. ...");
- ``ChatOpenAI`` at temperature 0 pointed at Tandem's inference service (its default model),
  with ``max_tokens`` set to the agent's answer budget so both answer at the same length cap.

The chain is the tutorial's variant that returns its sources (``RunnableParallel`` of the
retriever and the question, ``.assign(answer=...)``): those four chunks are the peer's
"citations" for the source metrics, which says more than a cited source does (the peer
never says which of the four it used).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from benchmarks.answers.sets import Page

CHUNK_SIZE = 1000
CHUNK_OVERLAP = 200
TOP_K = 4
SEPARATORS = ["\n\n", "\n", " ", ""]

# The tutorial's prompt (LangChain hub "rlm/rag-prompt"), one human message.
RAG_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question. If you don't know the answer, just say that you don't know. Use three "
    "sentences maximum and keep the answer concise.\n"
    "Question: {question} \n"
    "Context: {context} \n"
    "Answer:"
)


# -- RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200) ------------------------


def _split_keeping(text: str, separator: str) -> list[str]:
    if not separator:
        return [c for c in text if c]
    parts = re.split(f"({re.escape(separator)})", text)
    pieces = [parts[i] + parts[i + 1] for i in range(1, len(parts) - 1, 2)]
    if len(parts) % 2 == 0:
        pieces += parts[-1:]
    return [p for p in [parts[0], *pieces] if p]


def _merge(splits: Iterable[str], size: int, overlap: int) -> list[str]:
    docs: list[str] = []
    current: list[str] = []
    total = 0
    for piece in splits:
        n = len(piece)
        if total + n > size and current:
            doc = "".join(current).strip()
            if doc:
                docs.append(doc)
            while total > overlap or (total + n > size and total > 0):
                total -= len(current[0])
                current = current[1:]
        current.append(piece)
        total += n
    doc = "".join(current).strip()
    if doc:
        docs.append(doc)
    return docs


def split_text(
    text: str, size: int = CHUNK_SIZE, overlap: int = CHUNK_OVERLAP, separators: list[str] | None = None
) -> list[str]:
    """``RecursiveCharacterTextSplitter(chunk_size=size, chunk_overlap=overlap).split_text``."""
    seps = SEPARATORS if separators is None else separators
    separator, rest = seps[-1], []
    for i, s in enumerate(seps):
        if s == "":
            separator = s
            break
        if s in text:
            separator, rest = s, seps[i + 1 :]
            break
    out: list[str] = []
    good: list[str] = []
    for piece in _split_keeping(text, separator):
        if len(piece) < size:
            good.append(piece)
            continue
        if good:
            out += _merge(good, size, overlap)
            good = []
        out += split_text(piece, size, overlap, rest) if rest else [piece]
    if good:
        out += _merge(good, size, overlap)
    return out


# -- the chain ------------------------------------------------------------------------------


class PeerPipeline:
    """The tutorial's chain over ``pages``; ``ask`` streams one answer and times it."""

    def __init__(
        self,
        pages: list[Page],
        *,
        inference_url: str,
        api_key: str,
        model: str,
        embedding_model: str,
        max_tokens: int,
    ) -> None:
        import faiss
        from langchain_core.documents import Document
        from langchain_core.output_parsers import StrOutputParser
        from langchain_core.prompts import ChatPromptTemplate
        from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough
        from langchain_openai import ChatOpenAI, OpenAIEmbeddings

        base = inference_url.rstrip("/") + "/v1"
        self.embeddings = OpenAIEmbeddings(
            model=embedding_model,
            base_url=base,
            api_key=api_key,  # type: ignore[arg-type]
            check_embedding_ctx_length=False,  # send text, not tiktoken ids: the service embeds text
            # A 1,000-character chunk may pass the model's 256 tokens: cut it there, as
            # sentence-transformers (LangChain's HuggingFaceEmbeddings) does without asking.
            model_kwargs={"extra_body": {"truncate_prompt_tokens": 256}},
        )
        self.chunks: list[Any] = []
        for page in pages:
            meta: dict[str, Any] = {"source": page.source}
            if page.page is not None:
                meta["page"] = page.page
            self.chunks += [Document(page_content=c, metadata=meta) for c in split_text(page.text)]
        vectors = np.asarray(
            self.embeddings.embed_documents([c.page_content for c in self.chunks]), "float32"
        )
        self.index = faiss.IndexFlatL2(vectors.shape[1])
        self.index.add(vectors)

        def retrieve(question: str) -> list[Any]:
            q = np.asarray([self.embeddings.embed_query(question)], "float32")
            _dist, ids = self.index.search(q, min(TOP_K, len(self.chunks)))
            return [self.chunks[i] for i in ids[0] if i >= 0]

        def format_docs(docs: list[Any]) -> str:
            return "\n\n".join(d.page_content for d in docs)

        llm = ChatOpenAI(
            model=model,
            base_url=base,
            api_key=api_key,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=max_tokens,  # type: ignore[call-arg]
            streaming=True,
        )
        prompt = ChatPromptTemplate.from_messages([("human", RAG_PROMPT)])
        answer_chain = (
            RunnablePassthrough.assign(context=lambda x: format_docs(x["context"]))
            | prompt
            | llm
            | StrOutputParser()
        )
        self.chain = RunnableParallel(
            {"context": RunnableLambda(retrieve), "question": RunnablePassthrough()}
        ).assign(answer=answer_chain)

    def ask(self, question: str) -> dict[str, Any]:
        """The result in the shape ``eval_questions.judge`` reads; the retrieved chunks as its
        ``citations`` (document_id: the file name; page for a PDF)."""
        started = time.perf_counter()
        first: float | None = None
        answer: list[str] = []
        docs: list[Any] = []
        try:
            for part in self.chain.stream(question):
                if "context" in part:
                    docs = part["context"]
                if part.get("answer"):
                    if first is None:
                        first = time.perf_counter() - started
                    answer.append(part["answer"])
        except Exception as exc:  # the measurement goes on; the error is counted
            return {
                "answer": "",
                "error": f"{type(exc).__name__}: {exc}",
                "total": time.perf_counter() - started,
            }
        cites = [
            {"document_id": d.metadata["source"], "page": d.metadata.get("page"), "kind": "retrieved"}
            for d in docs
        ]
        return {
            "answer": "".join(answer),
            "done": {"citations": cites},
            "first": first,
            "total": time.perf_counter() - started,
        }
