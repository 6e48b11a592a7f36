"""DeepSeek V3 / R1 and V3.1 calls: the chat templates' shapes, the markers' exact
spelling, and malformed blocks."""

from __future__ import annotations

import pytest

from agentroll.parsers import DeepSeekV3ToolParser
from agentroll.parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

parser = DeepSeekV3ToolParser()


def v3(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def v31(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


def test_the_markers_are_spelled_with_the_fullwidth_bar_and_the_lower_block() -> None:
    assert CALLS_BEGIN == "<\uff5ctool\u2581calls\u2581begin\uff5c>"
    assert CALLS_END == "<\uff5ctool\u2581calls\u2581end\uff5c>"
    assert CALL_BEGIN == "<\uff5ctool\u2581call\u2581begin\uff5c>"
    assert CALL_END == "<\uff5ctool\u2581call\u2581end\uff5c>"
    assert SEP == "<\uff5ctool\u2581sep\uff5c>"


def test_the_v3_template_shape_with_two_calls_on_separate_lines() -> None:
    text = (
        CALLS_BEGIN
        + v3("get_weather", '{"location": "Tokyo, Japan"}')
        + "\n"
        + v3("get_time", '{\n  "tz": "Asia/Tokyo"\n}')
        + CALLS_END
    )
    out = parser.parse(text)
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        ("call_0", "get_weather", {"location": "Tokyo, Japan"}),
        ("call_1", "get_time", {"tz": "Asia/Tokyo"}),
    ]
    assert out.content == "" and out.errors == []


def test_the_v3_1_shape_after_reasoning_content() -> None:
    text = (
        "Let me look both up.\n\n"
        + CALLS_BEGIN
        + v31("get_current_weather", '{"location": "Tokyo"}')
        + v31("get_current_weather", '{"location": "Paris"}')
        + CALLS_END
    )
    out = parser.parse(text, call_id_prefix="call_2")
    assert out.content == "Let me look both up."
    assert [(c.id, c.arguments) for c in out.tool_calls] == [
        ("call_2_0", {"location": "Tokyo"}),
        ("call_2_1", {"location": "Paris"}),
    ]


def test_nested_unicode_arguments_content_after_the_block_and_a_tool_named_function() -> None:
    args = '{"query": "東京 天気", "filters": {"days": [1, 2], "units": {"temp": "°C"}}}'
    text = CALLS_BEGIN + v3("search", args) + v31("function", '{"x": 1}') + CALLS_END + " Done."
    out = parser.parse(text)
    assert out.content == "Done."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("search", {"query": "東京 天気", "filters": {"days": [1, 2], "units": {"temp": "°C"}}}),
        ("function", {"x": 1}),
    ]


def test_a_block_the_turn_ends_in_keeps_its_closed_calls() -> None:
    out = parser.parse(CALLS_BEGIN + v31("f", "{}"))
    assert [c.name for c in out.tool_calls] == ["f"] and out.errors == []


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (CALLS_BEGIN + f'{CALL_BEGIN}f{SEP}{{"a": 1}}', "not closed"),
        (CALLS_BEGIN + f'{CALL_BEGIN}f{SEP}{{"a": 1}}{CALLS_END}', "not closed"),
        (CALLS_BEGIN + v31("f", '{"a": }') + CALLS_END, "not valid JSON"),
        (CALLS_BEGIN + v3("g", "{'a': 1}") + CALLS_END, "not valid JSON"),
        (CALLS_BEGIN + v31("", '{"a": 1}') + CALLS_END, "no name"),
        (CALLS_BEGIN + f'{CALL_BEGIN}f {{"a": 1}}{CALL_END}' + CALLS_END, f"no {SEP}"),
        (CALLS_BEGIN + v31("f", "[1, 2]") + CALLS_END, "must be a JSON object"),
        (CALLS_BEGIN + v31("f", '{"a": "\\ud800"}') + CALLS_END, "lone surrogate"),
        (f"Done.{CALL_END}", "outside a tool-call block"),
    ],
)
def test_malformed_calls_are_errors(text: str, fragment: str) -> None:
    out = parser.parse(text)
    assert out.tool_calls == []
    assert any(fragment in e for e in out.errors), out.errors


def test_text_between_calls_is_one_error_and_the_calls_stand() -> None:
    text = CALLS_BEGIN + v31("a", "{}") + "I will also" + " call b" + v31("b", "{}") + CALLS_END
    out = parser.parse(text)
    assert [(c.id, c.name) for c in out.tool_calls] == [("call_0", "a"), ("call_2", "b")]
    assert len(out.errors) == 1 and "between the calls" in out.errors[0]


def test_a_call_begun_before_the_last_one_ended_is_an_error_and_the_next_stands() -> None:
    text = CALLS_BEGIN + f"{CALL_BEGIN}a{SEP}{{" + v31("b", "{}") + CALLS_END
    out = parser.parse(text)
    assert [c.name for c in out.tool_calls] == ["b"] and len(out.errors) == 1
