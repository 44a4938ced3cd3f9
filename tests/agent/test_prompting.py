import json
from pathlib import Path

import pytest

from services.agent.chunks import Chunk
from services.agent.prompting import TEMPLATE_TOKENS_PER_MESSAGE, BudgetPromptBuilder, PromptTooLong
from services.agent.protocol import Message, wire_messages
from services.agent.tokens import EstimatingCounter, HFTokenCounter, load_counter


def make_chunks(n: int, words: int) -> list[Chunk]:
    return [Chunk(f"c{i}", f"d{i}", " ".join(f"word{i}x{j}" for j in range(words))) for i in range(n)]


def total_tokens(counter, messages) -> int:  # type: ignore[no-untyped-def]
    return sum(counter.count(m.text()) + TEMPLATE_TOKENS_PER_MESSAGE for m in messages)


@pytest.fixture(scope="module")
def hf_counter(tiny_model_path: Path) -> HFTokenCounter:
    counter = load_counter(str(tiny_model_path))
    assert isinstance(counter, HFTokenCounter)
    return counter


def test_prompt_fits_budget_counted_with_the_real_tokenizer(hf_counter: HFTokenCounter) -> None:
    builder = BudgetPromptBuilder(hf_counter, context_tokens=600, answer_tokens=100)
    history = [
        Message(role="user", content="earlier " * 50),
        Message(role="assistant", content="reply " * 50),
    ]
    plan = builder.build("What is word3x4?", history, make_chunks(10, 60))
    assert total_tokens(hf_counter, plan.messages) <= 500
    assert plan.prompt_tokens <= plan.budget == 500
    assert 0 < len(plan.sources) < 10 and plan.dropped_sources == 10 - len(plan.sources)
    # Sources are numbered in the order given; the prompt shows documents 1..n.
    user = plan.messages[-1].text()
    for i in range(1, len(plan.sources) + 1):
        assert f'<document index="{i}"' in user
    assert "Question: What is word3x4?" in user


def test_last_source_is_cut_rather_than_dropped(hf_counter: HFTokenCounter) -> None:
    builder = BudgetPromptBuilder(hf_counter, context_tokens=400, answer_tokens=100)
    plan = builder.build("q?", [], make_chunks(1, 400))
    assert len(plan.sources) == 1 and plan.truncated == ["c0"]
    assert plan.messages[-1].text().rstrip().endswith("Question: q?")
    assert total_tokens(hf_counter, plan.messages) <= 300


def test_history_is_kept_newest_first() -> None:
    counter = EstimatingCounter()
    builder = BudgetPromptBuilder(counter, context_tokens=400, answer_tokens=100)
    history = [Message(role="user", content=f"turn {i} " + "x" * 200) for i in range(6)]
    plan = builder.build("q?", history, make_chunks(1, 20))
    kept = [m.text()[:6] for m in plan.messages[:-1]]
    assert kept and kept[-1] == "turn 5"
    assert plan.dropped_history == 6 - len(kept)


def test_question_too_long_for_the_window() -> None:
    builder = BudgetPromptBuilder(EstimatingCounter(), context_tokens=300, answer_tokens=100)
    with pytest.raises(PromptTooLong, match="budget is 200"):
        builder.build("x " * 1000, [], [])


def test_the_worked_example_comes_first_and_only_when_it_fits() -> None:
    counter = EstimatingCounter()
    roomy = BudgetPromptBuilder(counter, context_tokens=1200, answer_tokens=100, example=True)
    plan = roomy.build("q?", [Message(role="user", content="earlier")], make_chunks(1, 20))
    assert [m.role for m in plan.messages] == ["user", "assistant", "user", "user"]
    assert plan.messages[1].text().endswith("[2].") and "Quenby" in plan.messages[0].text()
    assert plan.prompt_tokens <= plan.budget
    # Sources come first: with no room left for it, the example is dropped, never a source.
    tight = BudgetPromptBuilder(counter, context_tokens=260, answer_tokens=100, example=True)
    plan = tight.build("q?", [], make_chunks(1, 20))
    assert len(plan.sources) == 1 and all("Quenby" not in m.text() for m in plan.messages)


def test_tool_fields_of_history_and_tail_reach_the_prompt_json() -> None:
    """An assistant's tool calls, a tool result's id and name: kept from the caller's messages to
    the JSON the model gets, as OpenAI writes them (unset fields left out); a result whose call
    was dropped goes with it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    sent = [
        {"role": "user", "content": "add 2"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2", "name": "add", "tool_call_id": "call_1"},
    ]
    history = [Message.model_validate(m) for m in sent]
    tail = [Message.model_validate(m) for m in sent[1:]]
    builder = BudgetPromptBuilder(EstimatingCounter(), context_tokens=1000, answer_tokens=100)
    wire = wire_messages(builder.build("q?", history, make_chunks(1, 5), tail).messages)
    assert wire[:3] == sent and wire[4:] == sent[1:] and wire[3]["role"] == "user"
    assert list(wire[2]) == ["role", "content", "name", "tool_call_id"]
    builder.max_history_messages = 1  # the call is left out: its result is too
    plan = builder.build("q?", history, make_chunks(1, 5))
    assert [m.role for m in plan.messages] == ["user"] and plan.dropped_history == 3


def test_generator_sampling_comes_from_settings_params_and_passthrough() -> None:
    from services.agent.config import AgentSettings
    from services.agent.pipelines.components import GenerateNode, InferenceGenerator
    from services.agent.pipelines.state import RunContext

    ctx = RunContext(AgentSettings(top_p=0.9), None, None, None, "m")  # type: ignore[arg-type]
    assert InferenceGenerator(None, None).sampling(ctx).model_dump() == {
        "max_tokens": 256,
        "temperature": 0.0,
        "top_p": 0.9,
    }
    p = GenerateNode.P.model_validate(
        {"temperature": 0.3, "top_p": 1.0, "sampling": {"presence_penalty": 0.5}}
    )
    gen = InferenceGenerator(p.max_tokens, p.temperature, p.top_p, p.sampling)
    assert gen.sampling(ctx).model_dump() == {"max_tokens": 256, "temperature": 0.3, "presence_penalty": 0.5}
    with pytest.raises(ValueError, match="top_p"):
        GenerateNode.P.model_validate({"top_p": 0})


def test_turn_records_keep_the_sampling_as_it_was_sent() -> None:
    """Only the fields a request gave (None included) are in a turn record's ``sampling``,
    the pipeline's own parameters too, and a stored record reads back to the same JSON."""
    from services.agent.clients import ChatRequest
    from services.agent.protocol import TurnRecord

    request = ChatRequest(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=5, seed=3)
    request.stop = ["\nObservation:"]
    request.response_format = None
    assert list(request.body()) == ["model", "messages", "max_tokens", "stop", "response_format", "seed"]
    record = TurnRecord(message_id="a", pipeline="p", model="m", sampling=request.sampling(), created_at=0.0)
    stored = record.model_dump_json(round_trip=True)
    want = {"max_tokens": 5, "stop": ["\nObservation:"], "response_format": None, "seed": 3}
    assert json.loads(stored)["sampling"] == want
    assert TurnRecord.model_validate_json(stored).model_dump_json(round_trip=True) == stored


def test_a_long_tables_later_piece_reads_with_its_header() -> None:
    header = "| plan | storage limit |\n| --- | --- |"
    hit = {"chunk_id": "t1", "document_id": "plans.xlsx", "text": "| team | 40 GB |", "table_header": header}
    builder = BudgetPromptBuilder(EstimatingCounter(), context_tokens=2000, answer_tokens=100)
    prompt = builder.build("q?", [], [Chunk.from_result(hit)]).messages[-1].text()
    assert header + "\n| team | 40 GB |" in prompt
    # a piece that already holds its header (the table's first) does not get it twice
    first = Chunk.from_result({**hit, "text": header + "\n| solo | 5 GB |"})
    assert builder.build("q?", [], [first]).messages[-1].text().count("storage limit") == 1
