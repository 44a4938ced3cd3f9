import pytest

from services.agent.agents.react import parse_react

TOOLS = ["calculator", "document_search"]


def test_strict_protocol() -> None:
    step = parse_react("Thought: multiply\nAction: calculator\nAction Input: 6 * 7", TOOLS)
    assert (step.kind, step.thought, step.tool, step.argument, step.repairs) == (
        "action",
        "multiply",
        "calculator",
        "6 * 7",
        [],
    )
    final = parse_react("Thought: done\nFinal Answer: 42", TOOLS)
    assert (final.kind, final.answer) == ("final", "42")


@pytest.mark.parametrize(
    ("text", "tool", "argument"),
    [
        ("action: Calculator\naction input: 2+3", "calculator", "2+3"),
        ("Action: calculator(2+3)", "calculator", "2+3"),
        ("Action: calcualtor\nAction Input: 2+3", "calculator", "2+3"),
        ('Action: `calculator`\nAction Input: "2+3"', "calculator", "2+3"),
        ('Action: calculator\nAction Input: {"expression": "2+3"}', "calculator", "2+3"),
        ("Action: calculator\nAction Input: 2+3\nObservation: 5\nFinal Answer: 5", "calculator", "2+3"),
        ("**Action:** calculator\n**Action Input:** 2+3", "calculator", "2+3"),
        ("Action: Document Search\nInput: capital of France", "document_search", "capital of France"),
        ("I will compute.\ncalculator(12*7)", "calculator", "12*7"),
        ("Action: calculator\nAction Input: 2+3\nmore rambling", "calculator", "2+3"),
        ("Thought: 99 - 45 = 42\nAction: 99 - 45 = 42\nFinal Answer: 42", "calculator", "99 - 45"),
    ],
)
def test_near_misses_are_repaired(text: str, tool: str, argument: str) -> None:
    step = parse_react(text, TOOLS)
    assert (step.kind, step.tool, step.argument) == ("action", tool, argument)
    if text != "Action: calculator\nAction Input: 2+3":
        assert step.repairs, text


def test_final_answer_variants() -> None:
    assert parse_react("final answer - 12", TOOLS).answer == "12"
    assert parse_react("Thought: ok\nFinal_Answer: 12", TOOLS).answer == "12"


def test_unrecoverable_outputs_are_invalid_with_a_reason() -> None:
    assert "unknown tool 'weather'" in parse_react("Action: weather\nAction Input: x", TOOLS).error
    assert "unknown tool '2024'" in parse_react("Action: 2024\nAction Input: x", TOOLS).error
    assert "no 'Action:'" in parse_react("I am not sure what to do.", TOOLS).error
    assert "no 'Action Input:'" in parse_react("Action: calculator", TOOLS).error
