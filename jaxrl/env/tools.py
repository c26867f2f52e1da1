"""Tool calls in the model's own text, the tool interface, and the calculator (docs/agentic.md#tools).

Two call syntaxes are parsed:
- Qwen3 / Hermes: ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>`` (``arguments``
  may also be a JSON string holding the object, as some chat templates emit it);
- optionally, fenced code blocks (```` ```python ... ``` ````), each a call of the ``python`` tool.

A malformed call (not JSON, not an object, no name, arguments that are not an object, an
unclosed tag) parses to a ``ToolCall`` with ``error`` set, so the model is told what was wrong
and the count lands in the metrics; nothing here raises on model text.

Model text is untrusted, so parsing is one left-to-right scan (linear in the text: each tag is
searched for once, from where the last call ended) and reads at most ``MAX_PARSED_CHARS``
characters; a longer text ends with an error call saying so.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import re
from typing import Any, Mapping, Protocol

from jaxrl.reward.base import describe_exception

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# Linear as it is: a fence whose lazy body finds no closing ``` leaves no later fence to try.
CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.S)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments``, or ``error`` (why it could not be parsed)."""

    name: str = ""
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    raw: str = ""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a tool answered. ``error``: the call failed (bad call, tool raised, code crashed);
    ``timed_out``: it was stopped at its time limit (also an error)."""

    text: str
    error: bool = False
    timed_out: bool = False


class Tool(Protocol):
    """A tool: ``name``, ``parameters`` (argument name -> JSON type name, all required), and a call
    on the parsed arguments. It may raise; ``call_tool`` turns that into an error result."""

    name: str
    description: str
    parameters: Mapping[str, str]

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult: ...


# A guard, far above any real turn (32K tokens of ~4 characters are ~130K), that bounds the
# parser's time and the error calls it makes on text from elsewhere (a user environment's).
MAX_PARSED_CHARS = 1_000_000


def _parse_json_call(body: str) -> ToolCall:
    raw = f"{OPEN_TAG}{body}{CLOSE_TAG}"
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e})", raw=raw)
    if not isinstance(value, dict):
        return ToolCall(error=f"the tool call must be a JSON object, got {type(value).__name__}", raw=raw)
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(error='the tool call has no "name" string', raw=raw)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error=f'"arguments" must be a JSON object, got {type(arguments).__name__}',
                        raw=raw)
    return ToolCall(name=name, arguments=arguments, raw=raw)


def _tagged_calls(text: str) -> list[tuple[int, ToolCall]]:
    """(offset, call) of every ``<tool_call>`` in ``text``, in one scan: a call's body runs to the
    first close tag after its open tag, the next call is searched for after that close tag; an
    open tag with no close tag after it is one error call, from the last open tag on."""
    found: list[tuple[int, ToolCall]] = []
    position = 0
    while (start := text.find(OPEN_TAG, position)) != -1:
        end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        if end == -1:  # nothing after this point closes, so every later open tag is unclosed too
            last = text.rfind(OPEN_TAG)
            found.append((last, ToolCall(error=f"{OPEN_TAG} is never closed with {CLOSE_TAG}", raw=text[last:])))
            break
        found.append((start, _parse_json_call(text[start + len(OPEN_TAG):end])))
        position = end + len(CLOSE_TAG)
    return found


def parse_tool_calls(text: str, code_blocks: bool = False, max_chars: int = MAX_PARSED_CHARS) -> list[ToolCall]:
    """The calls in ``text``, in the order they appear: ``<tool_call>`` JSON, and fenced python
    blocks when ``code_blocks``. A ``<tool_call>`` opened and never closed is one error call.

    Only the first ``max_chars`` characters are read (time linear in them); a longer ``text``
    gets one more error call, last, saying so: calls past the cap are not run.
    """
    scanned = text[:max_chars]
    found = _tagged_calls(scanned)
    if code_blocks:
        found += [(m.start(), ToolCall(name="python", arguments={"code": m.group(1)}, raw=m.group(0)))
                  for m in CODE_BLOCK.finditer(scanned)]
    if len(text) > max_chars:
        found.append((max_chars, ToolCall(error=f"the turn is {len(text)} characters long; tool calls are read from "
                                                f"its first {max_chars} characters only, nothing after them was run")))
    return [call for _, call in sorted(found, key=lambda item: item[0])]


_JSON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "object": dict,
               "array": list}


def call_tool(tools: Mapping[str, Tool], call: ToolCall) -> ToolResult:
    """Runs ``call`` on its tool; every failure (parse error, unknown tool, wrong arguments, the
    tool raising) is an error result the model sees, never an exception."""
    if call.error is not None:
        return ToolResult(f"Error: {call.error}", error=True)
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}", error=True)
    expected = dict(tool.parameters)
    missing, extra = sorted(set(expected) - set(call.arguments)), sorted(set(call.arguments) - set(expected))
    if missing or extra:
        return ToolResult(f"Error: tool {call.name!r} takes arguments {sorted(expected)}; missing {missing}, "
                          f"unexpected {extra}", error=True)
    for key, kind in expected.items():
        value = call.arguments[key]
        if not isinstance(value, _JSON_TYPES[kind]) or (kind != "boolean" and isinstance(value, bool)):
            return ToolResult(f"Error: argument {key!r} of tool {call.name!r} must be a {kind}, got "
                              f"{type(value).__name__}", error=True)
    try:
        return tool(call.arguments)
    except Exception as e:  # noqa: BLE001 - a tool bug is the model's observation, not a crashed rollout.
        return ToolResult(f"Error: tool {call.name!r} raised {describe_exception(e)}", error=True)


def tool_schema(tool: Tool) -> dict:
    """The OpenAI-style function schema chat templates render in the system prompt (``tools=``)."""
    return {"type": "function", "function": {
        "name": tool.name, "description": tool.description,
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in tool.parameters.items()},
                       "required": list(tool.parameters)}}}


# ------------------------------------------------------------------------------- the calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 1000
MAX_MAGNITUDE = 1e300  # results past this are refused rather than computed (10**10**10 would hang)


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary signs, parentheses.

    Walks the ``ast`` (never ``eval``: model text must not run), and bounds every intermediate
    value, so a huge power is a ValueError instead of hours of big-integer arithmetic.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"not an arithmetic expression ({getattr(e, 'msg', type(e).__name__)})") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and left not in (0, 1, -1) and abs(right * math.log10(abs(left))) > 300:
                raise ValueError("the result is too large")
            result = _BINARY[type(node.op)](left, right)
            if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
                raise ValueError("the result is too large or not real")
            return result
        raise ValueError(f"unsupported element {type(node).__name__}; only numbers and + - * / // % ** ( )")

    try:
        return value(tree.body)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


class Calculator:
    """The ``calculator`` tool: ``{"expression": "2 * (3 + 4)"}`` -> ``14``."""

    name = "calculator"
    description = "Evaluates an arithmetic expression (numbers, + - * / // % **, parentheses)."
    parameters = {"expression": "string"}

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        try:
            result = evaluate_arithmetic(arguments["expression"])
        except (ValueError, ZeroDivisionError, OverflowError) as e:
            return ToolResult(f"Error: {describe_exception(e)}", error=True)
        return ToolResult(repr(result))
