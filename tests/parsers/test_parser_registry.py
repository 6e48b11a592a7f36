"""The parser registry: built-in names, the plugin group's list, and the old import path."""

from __future__ import annotations

from agentroll import chat, parsers, plugins
from agentroll.parsers import TOOL_PARSERS, StreamingToolParser, get_tool_parser

NAMES = ["hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3"]


def test_the_built_in_names_are_the_plugin_groups_and_each_streams() -> None:
    assert list(TOOL_PARSERS) == NAMES == list(plugins.TOOL_PARSERS.builtin)
    for name in NAMES:
        assert get_tool_parser(name) is TOOL_PARSERS[name]
        assert isinstance(TOOL_PARSERS[name], StreamingToolParser)


def test_agentroll_chat_re_exports_the_same_objects() -> None:
    assert chat.TOOL_PARSERS is parsers.TOOL_PARSERS
    assert chat.get_tool_parser is parsers.get_tool_parser
    assert chat.HermesToolParser is parsers.HermesToolParser
    assert chat.ParsedOutput is parsers.ParsedOutput and chat.ToolParser is parsers.ToolParser
    assert chat._PARSER_PLUGINS is parsers._PARSER_PLUGINS


def test_the_public_names_are_pinned() -> None:
    assert parsers.__all__ == [
        "TOOL_PARSERS",
        "DeepSeekV3ToolParser",
        "HermesToolParser",
        "Llama3JSONToolParser",
        "MistralToolParser",
        "ParsedOutput",
        "QwenXMLToolParser",
        "StreamDelta",
        "StreamingParser",
        "StreamingToolParser",
        "ToolCallDelta",
        "ToolParser",
        "get_tool_parser",
    ]


def test_two_streams_of_one_parser_do_not_share_state() -> None:
    parser = TOOL_PARSERS["hermes"]
    assert isinstance(parser, StreamingToolParser)
    a, b = parser.stream(call_id_prefix="a"), parser.stream(call_id_prefix="b")
    a.feed('<tool_call>{"name": "x", ')
    b.feed("plain <tool_call>")
    a.feed('"arguments": {}}</tool_call>')
    assert [c.id for c in a.finish()[1].tool_calls] == ["a_0"]
    assert b.finish()[1].errors == ["a <tool_call> block is not closed with </tool_call>"]
