"""Qwen3-Coder XML calls: the documented shape, values typed by schema or by their look,
and malformed blocks."""

from __future__ import annotations

import pytest

from agentroll.parsers import QwenXMLToolParser
from agentroll.types import ToolSpec

parser = QwenXMLToolParser()
SCHEMAS = [
    ToolSpec(
        name="configure",
        description="",
        parameters={
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "replicas": {"type": "integer"},
                "ratio": {"type": "number"},
                "debug": {"type": "boolean"},
                "labels": {"type": "object"},
                "ports": {"type": "array"},
                "timeout": {"type": ["integer", "null"]},
                "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            },
        },
    )
]


def block(function: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


def test_the_qwen3_coder_example() -> None:
    text = (
        "<tool_call>\n<function=search_products>\n<parameter=query>\nwaterproof running shoes\n"
        "</parameter>\n<parameter=sort_by>\nprice_low_to_high\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    out = parser.parse(text)
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        (
            "call_0",
            "search_products",
            {"query": "waterproof running shoes", "sort_by": "price_low_to_high"},
        )
    ]
    assert out.content == "" and out.errors == []


def test_several_calls_between_content_with_unicode_and_multiline_values() -> None:
    code = "\ndef f():\n    return 'héllo'\n"  # its own first and last newline stay
    text = (
        "I'll write the file, then run it.\n"
        + block("write_file", path="/tmp/ü.py", content=code)
        + "\nNow run:\n"
        + block("shell", command="python3 /tmp/ü.py  ")
    )
    out = parser.parse(text)
    assert out.content == "I'll write the file, then run it.\n\nNow run:"
    assert [c.arguments for c in out.tool_calls] == [
        {"path": "/tmp/ü.py", "content": code},
        {"command": "python3 /tmp/ü.py  "},
    ]
    assert [c.id for c in out.tool_calls] == ["call_0", "call_1"]


def test_values_are_typed_by_the_tools_schema() -> None:
    typed = parser.with_tools(SCHEMAS)
    text = block(
        "configure",
        name="42",
        replicas="3",
        ratio="0.25",
        debug="True",
        labels='{"team": "rl", "tier": {"level": 2}}',
        ports="[80, 443]",
        timeout="null",
        mode="fast",
    )
    assert typed.parse(text).tool_calls[0].arguments == {
        "name": "42",  # a string stays a string, even when it looks like a number
        "replicas": 3,
        "ratio": 0.25,
        "debug": True,
        "labels": {"team": "rl", "tier": {"level": 2}},
        "ports": [80, 443],
        "timeout": None,
        "mode": "fast",
    }
    # a value its type does not fit stays a string, for the tool's validation to report
    out = typed.parse(block("configure", replicas="three", ratio="1e999"))
    assert out.tool_calls[0].arguments == {"replicas": "three", "ratio": "1e999"}
    # the parser it was made from keeps reading values by their look
    assert parser.parse(block("configure", name="42")).tool_calls[0].arguments == {"name": 42}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("5", 5),
        ("-2.5", -2.5),
        ("true", True),
        ("null", None),
        ('{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
        ("[1, 2]", [1, 2]),
        ("hello world", "hello world"),
        ('"quoted"', '"quoted"'),  # a JSON string is kept as written
        ("NaN", "NaN"),
        ("1e999", "1e999"),
        ("", ""),
    ],
)
def test_without_a_schema_only_valid_json_other_than_strings_is_converted(
    value: str, expected: object
) -> None:
    out = parser.parse(block("any_tool", v=value))
    assert out.tool_calls[0].arguments == {"v": expected}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("Let me look.\n<tool_call>\n<function=ls>\n<parameter=path>\n/\n", "not closed with"),
        ("<tool_call>\n<function=ls>\n<parameter=path>\n/\n</function>\n</tool_call>", "</parameter>"),
        ("<tool_call>\n<function=ls>\n<parameter=path>\n/\n</parameter>\n</tool_call>", "</function>"),
        ("<tool_call>\n<function=>\n</function>\n</tool_call>", "no name"),
        ('<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>', "must start with <function=NAME>"),
        ("<tool_call>\n<function=ls>\nplease\n</function>\n</tool_call>", "outside <parameter"),
        (block("ls", path="/").replace("</tool_call>", "extra</tool_call>"), "text after </function>"),
        (block("ls").replace("</function>", "<parameter=a>\n1\n</parameter>\n" * 2 + "</function>"), "twice"),
        ("<tool_call>\n<function=ls>\n<parameter=\n>1</parameter></function></tool_call>", "malformed"),
        ("done </tool_call>", "without its opening"),
        (block("ls", path='{"a": "\\ud800"}'), "lone surrogate"),
    ],
)  # fmt: skip
def test_malformed_blocks_are_errors(text: str, fragment: str) -> None:
    out = parser.parse(text)
    assert out.tool_calls == []
    assert any(fragment in e for e in out.errors), out.errors


def test_an_unclosed_block_leaves_the_content_before_it() -> None:
    out = parser.parse("Checking.\n<tool_call>\n<function=ls>\n")
    assert out.content == "Checking." and len(out.errors) == 1
