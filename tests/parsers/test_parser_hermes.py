"""Hermes / Qwen ``<tool_call>`` JSON calls: the documented shapes, malformed calls, and
the stream on the cases where it is easiest to get wrong."""

from __future__ import annotations

import pytest
from parser_streams import assemble, run_stream

from agentroll.parsers import HermesToolParser

parser = HermesToolParser()


def calls(text: str) -> list[tuple[str, str, dict[str, object]]]:
    return [(c.id, c.name, c.arguments) for c in parser.parse(text).tool_calls]


def test_the_hermes_2_pro_example_with_arguments_before_the_name() -> None:
    text = (
        "<tool_call>\n"
        '{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n'
        "</tool_call>"
    )
    assert calls(text) == [("call_0", "get_stock_fundamentals", {"symbol": "TSLA"})]


def test_the_qwen_example_with_two_calls() -> None:
    text = (
        "<tool_call>\n"
        '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
        '"date": "2024-10-01"}}\n'
        "</tool_call>"
    )
    out = parser.parse(text, call_id_prefix="call_3")
    assert [(c.id, c.name) for c in out.tool_calls] == [
        ("call_3_0", "get_current_temperature"),
        ("call_3_1", "get_temperature_date"),
    ]
    assert out.tool_calls[1].arguments["date"] == "2024-10-01"
    assert out.content == "" and out.errors == []


def test_nested_unicode_arguments_and_calls_between_content() -> None:
    text = (
        "Je traduis d'abord.\n<tool_call>\n"
        '{"name": "translate", "arguments": {"text": "こんにちは 👋", '
        '"options": {"formal": true, "targets": ["fr", "de"], "depth": {"a": [1, 2.5, null]}}}}\n'
        "</tool_call>\nPuis je cherche.\n"
        '<tool_call>{"name": "search", "parameters": {"q": "café"}}</tool_call>'
    )
    out = parser.parse(text)
    assert out.content == "Je traduis d'abord.\n\nPuis je cherche."
    assert out.tool_calls[0].arguments == {
        "text": "こんにちは 👋",
        "options": {"formal": True, "targets": ["fr", "de"], "depth": {"a": [1, 2.5, None]}},
    }
    assert (out.tool_calls[1].name, out.tool_calls[1].arguments) == ("search", {"q": "café"})


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('Sure <tool_call>{"name": "calc", "arguments": {"e": "1+1"}', "not closed"),
        ('<tool_call>{"name": "calc", "arguments": {"e": }}</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {"e": "1"}}</tool_call>', "no string 'name'"),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "no string 'name'"),
        (
            '<tool_call>{"name": "f", "arguments": ' + "[" * 300 + "]" * 300 + "}</tool_call>",
            "must be a JSON object",
        ),
        (
            '<tool_call>{"name": "f", "arguments": {"a": '
            + "[" * 300
            + "]" * 300
            + "}}</tool_call>",
            "nest deeper than 256",
        ),
    ],
)
def test_malformed_calls_are_errors_and_keep_no_call(text: str, fragment: str) -> None:
    out = parser.parse(text)
    assert out.tool_calls == []
    assert any(fragment in e for e in out.errors), out.errors


def test_errors_take_their_place_in_the_numbering_of_calls() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    out = parser.parse(text)
    assert [(c.id, c.name) for c in out.tool_calls] == [("call_0", "a"), ("call_2", "b")]
    assert len(out.errors) == 1


def test_a_renamed_call_is_announced_again_under_a_new_index() -> None:
    """A second "name" key wins in JSON: the early announcement is left without arguments."""
    text = '<tool_call>{"name": "first", "name": "second", "arguments": {"x": 1}}</tool_call>'
    run = run_stream(parser, list(text))
    announced = [p for d in run.deltas for p in d.tool_calls if p.name]
    assert [(p.index, p.name) for p in announced] == [(0, "first"), (1, "second")]
    assert (
        assemble(run.deltas)
        == [("call_0", "second", {"x": 1})]
        == [(c.id, c.name, c.arguments) for c in parser.parse(text).tool_calls]
    )


def test_a_marker_spliced_around_a_block_ends_the_content_in_the_stream_too() -> None:
    """``parse`` removes blocks first, so "<tool_" + block + "call>" leaves a "<tool_call>"."""
    text = 'Hi <tool_<tool_call>{"name": "a", "arguments": {}}</tool_call>call> lost'
    whole = parser.parse(text)
    assert whole.content == "Hi" and [c.name for c in whole.tool_calls] == ["a"]
    assert whole.errors == ["a <tool_call> block is not closed with </tool_call>"]
    for size in (1, 2, 5):
        run = run_stream(parser, [text[i : i + size] for i in range(0, len(text), size)])
        assert run.final == whole and run.content.strip() == "Hi"
