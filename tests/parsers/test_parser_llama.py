"""Llama 3.x JSON calls: the documented shapes, content that only looks like JSON, and
malformed calls."""

from __future__ import annotations

import pytest

from agentroll.parsers import Llama3JSONToolParser

parser = Llama3JSONToolParser()


def test_the_llama_3_1_model_card_example() -> None:
    text = (
        '{"name": "get_current_conditions", "parameters": '
        '{"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
    )
    out = parser.parse(text)
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        (
            "call_0",
            "get_current_conditions",
            {"location": "San Francisco, CA", "unit": "Fahrenheit"},
        )
    ]
    assert out.content == "" and out.errors == []


def test_python_tag_and_several_calls_separated_by_semicolons() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "arguments": {"city": "Zürich"}};'
        '{"type": "function", "name": "get_time", "parameters": "{\\"tz\\": \\"CET\\"}"}'
    )
    out = parser.parse(text, call_id_prefix="call_1")
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        ("call_1_0", "get_weather", {"city": "Paris"}),
        ("call_1_1", "get_weather", {"city": "Zürich"}),
        ("call_1_2", "get_time", {"tz": "CET"}),  # double-encoded parameters are decoded
    ]
    assert out.content == "" and out.errors == []


def test_calls_between_content_with_nested_unicode_arguments() -> None:
    text = (
        "Je vérifie la météo.\n"
        '{"name": "forecast", "parameters": {"place": {"city": "Kraków", "geo": [50.06, 19.94]}, '
        '"days": 3, "notes": "☀️ or 🌧"}}\nPuis je réponds.'
    )
    out = parser.parse(text)
    assert out.content == "Je vérifie la météo.\n\nPuis je réponds."
    assert out.tool_calls[0].arguments == {
        "place": {"city": "Kraków", "geo": [50.06, 19.94]},
        "days": 3,
        "notes": "☀️ or 🌧",
    }


@pytest.mark.parametrize(
    "text",
    [
        '{"answer": 42, "unit": "m"}',
        '{"name": "Alice", "age": 30}',  # a name but no parameters: an object, not a call
        "Use a set: {1, 2, 3}.",
        "function f() { return {a: 1}; }",
        '{"type": "object", "properties": {"name": {"type": "string"}}}',
        "{ unbalanced brace in prose",
        "{}",
    ],
)
def test_content_that_starts_with_a_brace_but_is_no_call_stays_content(text: str) -> None:
    out = parser.parse(text)
    assert (out.content, out.tool_calls, out.errors) == (text, [], [])


def test_a_call_inside_content_json_is_still_a_call() -> None:
    out = parser.parse('{"answer": {"name": "f", "parameters": {}}}')
    assert [c.name for c in out.tool_calls] == ["f"] and out.content == '{"answer": }'


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('Calling: {"name": "get_weather", "parameters": {"city": "Par', "not closed"),
        ('{"name": "get_weather", "parameters": {"city": Paris}}', "not valid JSON"),
        ('{"parameters": {"city": "Paris"}}', "no string 'name'"),
        ('{"name": 7, "parameters": {}}', "no string 'name'"),
        ('{"name": "f", "parameters": [1, 2]}', "must be a JSON object"),
        ('<|python_tag|>brave_search.call(query="weather")', "not followed by a JSON call"),
        ('<|python_tag|>{"query": "weather"}', "not a tool call"),
        ("<|python_tag|>", "not followed by a JSON call"),
        ('{"name": "f", "parameters": {"s": "\\udc00"}}', "lone surrogate"),
    ],
)
def test_malformed_calls_are_errors(text: str, fragment: str) -> None:
    out = parser.parse(text)
    assert out.tool_calls == []
    assert any(fragment in e for e in out.errors), out.errors


def test_an_error_takes_its_place_in_the_numbering() -> None:
    out = parser.parse('{"parameters": {}}; {"name": "ok", "parameters": {}}')
    assert [c.id for c in out.tool_calls] == ["call_1"] and len(out.errors) == 1
