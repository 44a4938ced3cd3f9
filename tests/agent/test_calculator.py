import pytest

from services.agent.tools.base import ToolContext
from services.agent.tools.calculator import Calculator, CalculatorError, evaluate


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("2 + 3 * 4", 14),
        ("(12 + 30) * 2", 84),
        ("2^10", 1024),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-3 ** 2", -9),
        ("sqrt(16) + abs(-2)", 6),
        ("1,234 + 1", 1235),
        ("max(1, 5, 3)", 5),
        ("round(pi, 2)", 3.14),
        ("12 × 3 =", 36),
    ],
)
def test_arithmetic(expr: str, value: float) -> None:
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("__import__('os').system('echo hi')", "unsupported"),
        ("open('/etc/passwd')", "unsupported"),
        ("(1).__class__", "unsupported"),
        ("x + 1", "unsupported"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 400", "too large"),
        ("1 / 0", "division by zero"),
        ("", "empty"),
        ("1 +", "not an arithmetic expression"),
        ("1" + "+1" * 200, "longer than"),
        ("[1, 2]", "unsupported"),
        ("'a' * 3", "not a number"),
        ("sqrt(-1)", "sqrt"),
    ],
)
def test_refusals(expr: str, reason: str) -> None:
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expr)


def test_tool_returns_errors_as_text() -> None:
    calc = Calculator()
    assert calc.run({"expression": "6*7"}, ToolContext()) == "42"
    assert calc.run("1/0", ToolContext()).startswith("error: division by zero")
