"""A safe arithmetic evaluator, usable as the ``calculate`` tool (no sandbox needed).

Invariants: only numbers, ``+ - * / // % **``, unary ``+``/``-`` and parentheses are
evaluated (walking the ``ast``, never ``eval``); integer results are bounded to
``MAX_INT_BITS`` bits and checked *before* a power is computed, so ``9**9**9`` fails at
once; every rejection is a ``ToolError`` whose message tells the model what is allowed.
"""

from __future__ import annotations

import ast
import math
import operator
import typing
from collections.abc import Callable
from typing import Any

from agentroll.errors import ToolError
from agentroll.tool import tool

MAX_INT_BITS = 8192
MAX_EXPRESSION_CHARS = 1000
ALLOWED = "numbers, + - * / // % **, unary + and -, and parentheses"
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool
        return _check_size(typing.cast(int | float, node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check_size(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        # (bit_length - 1) * exponent is a lower bound of a power's size: refuse it early.
        if (
            isinstance(node.op, ast.Pow)
            and isinstance(left, int)
            and isinstance(right, int)
            and (abs(left).bit_length() - 1) * right > MAX_INT_BITS
        ):
            raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large for a floating-point number") from None
    raise ToolError(f"{ast.unparse(node)!r} is not allowed; use only {ALLOWED}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; raises ``ToolError`` on anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise ToolError(f"cannot parse {expression!r}; allowed: {ALLOWED}") from exc
    return _eval(tree.body)


@tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay integers).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(17 + 4) * 3".
    """
    return str(evaluate(expression))
