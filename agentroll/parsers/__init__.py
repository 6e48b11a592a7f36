"""Tool-call parsers of the major open model families, whole-turn and streaming.

Invariants: a parser never raises on model output (a malformed call is an entry in
``errors`` that says what to write instead); a built-in parser is stateless, so one object
serves every episode; ``stream()`` of a built-in parser finishes with ``parse()``'s result.
``TOOL_PARSERS`` is live: code may add to it, and names not in it come from plugins.
"""

from __future__ import annotations

from agentroll.errors import ConfigError
from agentroll.parsers.base import (
    ParsedOutput,
    StreamDelta,
    StreamingParser,
    StreamingToolParser,
    ToolCallDelta,
    ToolParser,
)
from agentroll.parsers.deepseek import DeepSeekV3ToolParser
from agentroll.parsers.hermes import HermesToolParser
from agentroll.parsers.llama import Llama3JSONToolParser
from agentroll.parsers.mistral import MistralToolParser
from agentroll.parsers.qwen_xml import QwenXMLToolParser
from agentroll.plugins import TOOL_PARSERS as _PARSER_GROUP

TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": HermesToolParser(),
    "qwen3_coder": QwenXMLToolParser(),
    "llama3_json": Llama3JSONToolParser(),
    "mistral": MistralToolParser(),
    "deepseek_v3": DeepSeekV3ToolParser(),
}
# the built-in names are this dict's keys as they are at each lookup
_PARSER_PLUGINS = _PARSER_GROUP.over(TOOL_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """The tool parser called ``name``: one of ``TOOL_PARSERS`` (code may add to it), else a
    fresh one from the factory registered under that name in entry point group
    ``agentroll.tool_parsers``.  Raises ``ConfigError`` naming the known parsers when there
    is none, or when the plugin's object has no ``parse`` method."""
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]
    parser = _PARSER_PLUGINS.load(name)()
    if not isinstance(parser, ToolParser):
        raise ConfigError(
            f"tool parser {name!r} made a {type(parser).__name__} without a parse() method; "
            "its entry point must name a ToolParser class (or a factory returning one)"
        )
    return parser


__all__ = [
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
