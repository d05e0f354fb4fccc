"""A tiny arithmetic language for a check's `expected`: numbers, names, + - * / ** and min/max/abs."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from asyncps.tools.experiment.errors import ExperimentError

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., float]] = {"min": min, "max": max, "abs": abs}


def evaluate_expression(text: str, names: Callable[[str], Any]) -> float:
    """Evaluate an arithmetic expression (no attribute access, no other calls)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ExperimentError(f"bad expression {text!r}") from None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name):
            return float(names(node.id))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](ev(node.left), ev(node.right))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords):
            return float(_FUNCTIONS[node.func.id](*(ev(a) for a in node.args)))
        raise ExperimentError(f"expression {text!r}: only numbers, names, + - * / ** and min/max/abs")

    return ev(tree)
