"""Mistral ``[TOOL_CALLS]`` calls: the JSON list (tokenizers before v11) and the v11+
``NAME[ARGS]{...}`` form with its optional ``[CALL_ID]``, and malformed calls."""

from __future__ import annotations

import pytest

from agentroll.parsers import MistralToolParser

parser = MistralToolParser()


def calls(text: str) -> list[tuple[str, str, dict[str, object]]]:
    return [(c.id, c.name, c.arguments) for c in parser.parse(text).tool_calls]


def test_the_pre_v11_list_with_two_calls() -> None:
    text = (
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}, {"name": "add", "arguments": {"a": 3.5, "b": 4}}]'
    )
    assert calls(text) == [
        ("call_0", "get_current_weather", {"location": "Paris, France", "format": "celsius"}),
        ("call_1", "add", {"a": 3.5, "b": 4}),
    ]


def test_the_v11_form_repeated_with_and_without_a_call_id() -> None:
    text = (
        'Let me check both.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France"}'
        '[TOOL_CALLS]get_current_weather[CALL_ID]a1B2c3D4e[ARGS]{"location": "Tōkyō"}'
    )
    out = parser.parse(text)
    assert out.content == "Let me check both." and out.errors == []
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        ("call_0", "get_current_weather", {"location": "Paris, France"}),
        ("a1B2c3D4e", "get_current_weather", {"location": "Tōkyō"}),
    ]


def test_arguments_right_after_the_name_when_special_tokens_were_not_decoded() -> None:
    assert calls('[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}') == [
        ("call_0", "add_this_and_that", {"a": 3.5, "b": 4})
    ]


def test_nested_unicode_arguments_and_content_around_calls() -> None:
    text = (
        "Voilà.[TOOL_CALLS]bash[ARGS]"
        '{"command": "print(\\"héllo {}\\")", "env": {"LANG": "C.UTF-8", "paths": ["/a", "/b"]}}'
        " Terminé."
    )
    out = parser.parse(text)
    assert out.content == "Voilà. Terminé."
    assert out.tool_calls[0].arguments == {
        "command": 'print("héllo {}")',
        "env": {"LANG": "C.UTF-8", "paths": ["/a", "/b"]},
    }


def test_a_call_id_used_twice_in_a_turn_is_replaced() -> None:
    text = "[TOOL_CALLS]a[CALL_ID]same[ARGS]{}[TOOL_CALLS]b[CALL_ID]same[ARGS]{}"
    assert [c[0] for c in calls(text)] == ["same", "call_1"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1', "not closed with ]"),
        ('[TOOL_CALLS]add[ARGS]{"a": 1', "are not closed"),
        ('[TOOL_CALLS][{"name": "add", "arguments": {a: 1}}]', "not valid JSON"),
        ('[TOOL_CALLS]add[ARGS]{"a": }', "not valid JSON"),
        ('[TOOL_CALLS][{"arguments": {"a": 1}}]', "no string 'name'"),
        ('[TOOL_CALLS][ARGS]{"a": 1}', "no string 'name'"),
        ('[TOOL_CALLS][{"name": "add", "arguments": "x"}]', "not a JSON object"),
        ('[TOOL_CALLS]["add", 1]', "something other than call objects"),
        ("[TOOL_CALLS]I cannot call a tool here.", "not followed by its arguments"),
        ("[TOOL_CALLS]get_weather", "not followed by its arguments"),
        ("[TOOL_CALLS]", "not followed by its arguments"),
        ('[TOOL_CALLS]f[CALL_ID][ARGS]{"a": "\\ud800"}', "lone surrogate"),
    ],
)
def test_malformed_calls_are_errors(text: str, fragment: str) -> None:
    out = parser.parse(text)
    assert out.tool_calls == []
    assert any(fragment in e for e in out.errors), out.errors


def test_a_bad_element_does_not_spoil_the_good_ones_of_a_list() -> None:
    out = parser.parse(
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"arguments": {}}, {"name": "b"}]'
    )
    assert [(c.id, c.name) for c in out.tool_calls] == [("call_0", "a"), ("call_2", "b")]
    assert len(out.errors) == 1


def test_a_list_cut_short_keeps_its_closed_calls_and_says_it_is_unclosed() -> None:
    out = parser.parse('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "argu')
    assert [c.name for c in out.tool_calls] == ["a"]
    assert out.errors and "not closed with ]" in out.errors[0]


def test_prose_after_a_bare_tool_calls_marker_is_kept_as_content() -> None:
    out = parser.parse("[TOOL_CALLS]I cannot do that.")
    assert out.content == "I cannot do that." and len(out.errors) == 1
