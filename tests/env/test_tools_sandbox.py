"""The tool-call parser and the calculator (docs/agentic.md#tools); the python tool's sandbox is tests/sandbox."""

import pytest

from jaxrl.env import Calculator, ToolCall, call_tool, evaluate_arithmetic, parse_tool_calls

TOOLS = {"calculator": Calculator()}


def test_parser_reads_well_formed_calls_in_order():
    text = ('first <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> then '
            '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None), ("python", {"code": "print(1)"}, None)]


def test_parser_reports_malformed_calls_instead_of_raising():
    text = ("<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
            '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": 3}</tool_call>'
            '<tool_call>{"name": "calculator"')
    errors = [c.error for c in parse_tool_calls(text)]
    assert len(errors) == 5 and all(errors)
    assert "not valid JSON" in errors[0] and "JSON object" in errors[1] and '"name"' in errors[2]
    assert '"arguments"' in errors[3] and "never closed" in errors[4]
    assert parse_tool_calls("no calls here, ```python\nprint(1)\n```") == []


def test_parser_reads_fenced_code_blocks_when_asked():
    calls = parse_tool_calls("look:\n```python\nprint(6 * 7)\n```\nand ```py\nx = 1\n```", code_blocks=True)
    assert [(c.name, c.arguments["code"]) for c in calls] == [("python", "print(6 * 7)\n"), ("python", "x = 1\n")]


def test_bad_calls_become_error_results():
    results = [call_tool(TOOLS, call) for call in (
        ToolCall(error="broken"), ToolCall(name="search", arguments={"q": "x"}),
        ToolCall(name="calculator", arguments={"expr": "1"}),
        ToolCall(name="calculator", arguments={"expression": 5}),
        ToolCall(name="calculator", arguments={"expression": "1/0"}))]
    assert all(r.error for r in results)
    assert "unknown tool 'search'" in results[1].text and "missing ['expression']" in results[2].text
    assert "must be a string" in results[3].text and "ZeroDivisionError" in results[4].text


def test_calculator_is_arithmetic_only_and_bounded():
    assert evaluate_arithmetic("2 * (3 + 4) - 10 // 3") == 11
    assert evaluate_arithmetic("2 ** -1") == 0.5
    for bad in ("__import__('os').system('true')", "10 ** 10 ** 10", "x + 1", "-" * 2000 + "1", "[1, 2]"):
        with pytest.raises(ValueError):
            evaluate_arithmetic(bad)

