"""A safe arithmetic evaluator over Python's ``ast`` (never ``eval``).

Only numbers, + - * / // % **, unary signs, parentheses and a few math functions
and constants are accepted; sizes are bounded so that ``9**9**9`` or a huge
factorial cannot stall the service.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from services.agent.tools.base import ToolContext, argument_text, single_string_schema

MAX_EXPRESSION_CHARS = 300
MAX_NODES = 200
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e300

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "log": math.log,
    "log10": math.log10,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "floor": math.floor,
    "ceil": math.ceil,
}
_CONSTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
# What a forced calculator call may write (its JSON schema's pattern), so constrained decoding keeps a
# small model to arithmetic: without it SmolLM2-135M writes '}}, {' or 'twenty five' as the
# expression, with bare names allowed '10.81minesineloge', with any first character '.1234 + 4321'.
# Terms (a number of at most 12 digits and 6 decimals, pi or tau, behind signs, parentheses or a
# function's name and parenthesis) joined by operators; bounded by the pattern itself, as xgrammar
# ignores maxLength next to a pattern. The calculator itself accepts more (normalize, evaluate).
_FUNC_NAMES = "|".join(sorted(_FUNCS, key=len, reverse=True))  # log10 before log: longest first
_TERM = rf"(-|\(|({_FUNC_NAMES})\(){{0,4}}([0-9]{{1,12}}(\.[0-9]{{1,6}})?|pi|tau)\){{0,4}}"
EXPRESSION_PATTERN = rf"^{_TERM}( ?([-+*/%^,]|\*\*) ?{_TERM}){{0,8}}$"


class CalculatorError(ValueError):
    pass


def _check(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculatorError(f"not a number: {value!r}")
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        raise CalculatorError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result too large")
    return value


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (
            abs(right) > MAX_EXPONENT or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 300)
        ):
            raise CalculatorError(f"power {left}**{right} too large")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCS
        and not node.keywords
    ):
        args = [_eval(a) for a in node.args]
        try:
            return _check(_FUNCS[node.func.id](*args))
        except (ValueError, TypeError, OverflowError) as exc:
            raise CalculatorError(f"{node.func.id}: {exc}") from None
    raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:60]}")


def normalize(expression: str) -> str:
    """Repairs of how models write arithmetic: '^' for power, '×'/'÷', thousands separators
    ("1,000" only when the comma is followed by exactly three digits), a trailing '='."""
    text = expression.strip().strip("`").strip()
    text = text.replace("^", "**").replace("×", "*").replace("÷", "/").replace("−", "-")
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    return text.rstrip("=").strip()


def evaluate(expression: str) -> int | float:
    text = normalize(expression)
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError("expression too complex")
    result = _eval(tree)
    if isinstance(result, float) and result.is_integer() and abs(result) < 1e15:
        return int(result)
    return result


class Calculator:
    name = "calculator"
    description = "Evaluates an arithmetic expression, e.g. (12 + 30) * 2 or sqrt(16). Input: the expression."
    parameters = single_string_schema("expression", "the arithmetic expression", pattern=EXPRESSION_PATTERN)

    def run(self, argument: Any, ctx: ToolContext) -> str:
        try:
            return str(evaluate(argument_text(argument, "expression")))
        except CalculatorError as exc:
            return f"error: {exc}"
