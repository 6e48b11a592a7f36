"""The streaming contract, as properties over random texts and random chunkings, for every
built-in parser: feed/finish never raise; content deltas are the parse's content; tool-call
deltas assemble to the parse's calls; finish() is parse(); text is not held back needlessly;
a call's name comes before its end; a long turn costs linear time."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parser_streams import assemble, chunked, expected_calls, run_stream, same

from agentroll.parsers import (
    TOOL_PARSERS,
    DeepSeekV3ToolParser,
    HermesToolParser,
    Llama3JSONToolParser,
    MistralToolParser,
    QwenXMLToolParser,
    StreamingToolParser,
)
from agentroll.parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from agentroll.types import ToolSpec, encode_msgpack

QWEN_TOOLS = [
    ToolSpec(
        name="f",
        description="",
        parameters={
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "s": {"type": "string"},
                "o": {"type": "object"},
                "b": {"type": ["boolean", "null"]},
            },
        },
    )
]

JSON_BITS = ['{"a": 1}', "{", "}", "[", "]", '"', "\\", ",", ":", " ", "\n", "1e999", "NaN"]
JSON_BITS += ['"\\ud800"', '"é"', "null", '{"k": {"deep": [1, {"x": "y"}]}}']
PIECES: dict[str, list[str]] = {
    "hermes": [
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "call>",
        '{"name": "f", "arguments": ',
        '{"name": "g"}',
        '{"arguments": {}, "name": "h"}',
        '{"name": "f", "name": "g", "arguments": {}}</tool_call>',
        '"name"',
    ],
    "qwen3_coder": [
        "<tool_call>",
        "</tool_call>",
        "\n<function=f>\n",
        "<function=",
        "<parameter=n>\n",
        "<parameter=s>",
        "<parameter=o>\n",
        "\n</parameter>\n",
        "</parameter>",
        "</function>",
        "5",
        "true",
        "<",
    ],
    "llama3_json": [
        "<|python_tag|>",
        '{"name": "f", "parameters": ',
        '{"name": ',
        '"f"',
        ', "parameters": ',
        ', "arguments": ',
        '{"type": "function", ',
        '{"parameters": ',
        '{"name": "f", "parameters": {}, "name": "g"}',
        ";",
        "<|python",
    ],
    "mistral": [
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "[TOOL_",
        "abc123def",
        "f",
        "get_weather",
        '{"name": "f", "arguments": ',
        '[{"name": "g", "arguments": {"q": 2}}]',
        '[{"name": "f", "arguments": {}, "name": "g"}]',
    ],
    "deepseek_v3": [
        CALLS_BEGIN,
        CALLS_END,
        CALL_BEGIN,
        CALL_END,
        SEP,
        CALL_BEGIN[:5],
        "function",
        "get_weather",
        "\n```json\n",
        "\n```",
    ],
}
PARSERS: dict[str, StreamingToolParser] = {
    name: parser for name, parser in TOOL_PARSERS.items() if isinstance(parser, StreamingToolParser)
}
PARSERS["qwen3_coder+tools"] = QwenXMLToolParser(QWEN_TOOLS)
PIECES["qwen3_coder+tools"] = PIECES["qwen3_coder"]


def random_texts(name: str) -> st.SearchStrategy[str]:
    pieces = st.sampled_from(PIECES[name] + JSON_BITS)
    return st.lists(st.one_of(pieces, pieces, st.text(max_size=12)), max_size=30).map("".join)


names = st.sampled_from(["f", "get_weather", "é_tool", "ns.search", "function"])
# strings with the characters that matter to the scanners: quotes, escapes, brackets, markers
tricky = st.text(st.sampled_from('ab"\\{}[]<>;é \n'), max_size=8)
scalars = (
    st.one_of(
        st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(-1e6, 1e6), st.text(max_size=8)
    )
    | tricky
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
arguments = st.dictionaries(st.sampled_from(["n", "s", "o", "b", "city", "q"]), values, max_size=3)


def _qwen_value(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@st.composite
def calls(draw: st.DrawFn, name: str) -> str:
    """One well-formed call of the format ``name`` (a few in one block where it has them)."""
    fn, args = draw(names), draw(arguments)
    dumped = json.dumps(args, ensure_ascii=draw(st.booleans()))
    # a second "name" key: the name announced early is not the one the call ends up with
    renamed = ', "name": "other"' if draw(st.integers(0, 9)) == 0 else ""
    if name == "hermes":
        key = draw(st.sampled_from(["arguments", "parameters"]))
        body = f'{{"name": {json.dumps(fn)}, "{key}": {dumped}{renamed}}}'
        return f"<tool_call>\n{body}\n</tool_call>"
    if name.startswith("qwen3_coder"):
        params = "".join(
            f"<parameter={k}>\n{_qwen_value(v)}\n</parameter>\n" for k, v in args.items()
        )
        return f"<tool_call>\n<function={fn}>\n{params}</function>\n</tool_call>"
    if name == "llama3_json":
        key = draw(st.sampled_from(["parameters", "arguments"]))
        tag = draw(st.sampled_from(["", "<|python_tag|>"]))
        return f'{tag}{{"name": {json.dumps(fn)}, "{key}": {dumped}{renamed}}}' + draw(
            st.sampled_from(["", ";", "; "])
        )
    if name == "mistral":
        if draw(st.booleans()):
            more = draw(st.lists(st.tuples(names, arguments), max_size=2))
            items = [{"name": n, "arguments": a} for n, a in [(fn, args), *more]]
            listed = json.dumps(items)
            if renamed:
                listed = listed.replace("}]", '}, "name": "other"}]', 1)
            return f"[TOOL_CALLS]{draw(st.sampled_from(['', ' ']))}{listed}"
        call_id = draw(st.sampled_from(["", "[CALL_ID]abc123def", "[CALL_ID]Xy9"]))
        sep = draw(st.sampled_from(["[ARGS]", ""]))
        return f"[TOOL_CALLS]{fn.replace('.', '_')}{call_id}{sep}{dumped}"
    inner = []
    for one, its in [(fn, args), *draw(st.lists(st.tuples(names, arguments), max_size=2))]:
        dumped = json.dumps(its)
        if draw(st.booleans()):  # V3 / R1
            inner.append(f"{CALL_BEGIN}function{SEP}{one}\n```json\n{dumped}\n```{CALL_END}")
        else:  # V3.1
            inner.append(f"{CALL_BEGIN}{one}{SEP}{dumped}{CALL_END}")
    return CALLS_BEGIN + "\n".join(inner) + CALLS_END


@st.composite
def structured_texts(draw: st.DrawFn, name: str) -> str:
    """Content and well-formed calls, then perhaps cut short or with a piece put in."""
    words = st.sampled_from(["Let me check.", " ", "\n", "{x}", "a [b] c", "<b>", "é", "{}"])
    segments = st.one_of(calls(name), words, st.text(max_size=10))
    text = "".join(draw(st.lists(segments, max_size=6)))
    if text and draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]  # a truncated turn
    if text and draw(st.booleans()):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(PIECES[name] + JSON_BITS)) + text[at:]
    return text


def texts(name: str) -> st.SearchStrategy[str]:
    return st.one_of(random_texts(name), structured_texts(name))


def test_every_built_in_parser_streams() -> None:
    assert set(PARSERS) >= set(TOOL_PARSERS)


@pytest.mark.parametrize("name", sorted(PARSERS))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stream_agrees_with_parse_for_any_chunking(name: str, data: st.DataObject) -> None:
    parser = PARSERS[name]
    text = data.draw(texts(name), label="text")
    every = list(range(len(text)))  # one character per feed
    cuts = data.draw(
        st.one_of(st.lists(st.integers(0, len(text)), max_size=12), st.just(every)), label="cuts"
    )
    whole = parser.parse(text, call_id_prefix="t")
    run = run_stream(parser, chunked(text, cuts), call_id_prefix="t")
    assert run.final == whole
    assert run.content.strip() == whole.content
    assert same(assemble(run.deltas), expected_calls(whole.tool_calls))
    for call in whole.tool_calls:
        encode_msgpack(call)  # every call can go into a trajectory
    assert len({c.id for c in whole.tool_calls}) == len(whole.tool_calls)


MARKER_CHARS = {
    "hermes": "<",
    "qwen3_coder": "<",
    "llama3_json": "<{",
    "mistral": "[",
    "deepseek_v3": "<",
}


@pytest.mark.parametrize("name", sorted(MARKER_CHARS))
@settings(max_examples=100, deadline=None)
@given(chunks=st.lists(st.text(max_size=20), max_size=10))
def test_text_that_cannot_start_a_call_is_emitted_by_the_feed_that_receives_it(
    name: str, chunks: list[str]
) -> None:
    chunks = ["".join(ch for ch in c if ch not in MARKER_CHARS[name]) for c in chunks]
    run = run_stream(PARSERS[name], chunks)
    assert [d.content for d in run.deltas[:-1]] == chunks
    assert run.deltas[-1].content == "" and run.final.errors == []


# a well-formed call, and the text that closes it (its name must be out before that)
CALLS = [
    (HermesToolParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n', "</tool_call>"),
    (QwenXMLToolParser(), "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n", "</tool_call>"),
    (Llama3JSONToolParser(), '{"name": "get_weather", "parameters": {"city": "Oslo"', "}}"),
    (MistralToolParser(), '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"', "}"),
    (MistralToolParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}', "}]"),
    (DeepSeekV3ToolParser(), f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Oslo"}}', CALL_END + CALLS_END),
    (DeepSeekV3ToolParser(), f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Oslo"}}\n```', CALL_END + CALLS_END),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "opening", "closing"), CALLS)
def test_a_call_is_named_before_it_closes_and_gets_its_arguments_when_it_does(
    parser: StreamingToolParser, opening: str, closing: str
) -> None:
    run = run_stream(parser, ["Let me check. ", *opening, closing])
    assert run.deltas[0].content == "Let me check. "
    named = [i for i, d in enumerate(run.deltas) if any(p.name for p in d.tool_calls)]
    assert named and named[0] <= len(opening), "the name waited for the end of the call"
    assert run.deltas[len(opening) + 1].tool_calls[-1].arguments == '{"city": "Oslo"}'
    assert assemble(run.deltas) == [("call_0", "get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("name", sorted(MARKER_CHARS))
def test_a_long_turn_costs_linear_time(name: str) -> None:
    """A 400 kB turn fed 4 characters at a time: re-scanning the buffered text at each feed
    would take minutes."""
    parser = PARSERS[name]
    opening, closing = next((o, c) for p, o, c in CALLS if type(p) is type(parser))
    value = "y" * 200_000
    call = opening.replace("Oslo", value) + closing
    text = "plain words " * 16_000 + call
    start = time.perf_counter()
    run = run_stream(parser, [text[i : i + 4] for i in range(0, len(text), 4)])
    assert time.perf_counter() - start < 20
    assert [c.arguments for c in run.final.tool_calls] == [{"city": value}]


@pytest.mark.parametrize(("parser", "opening", "closing"), CALLS)
def test_many_calls_in_one_feed_cost_linear_time(
    parser: StreamingToolParser, opening: str, closing: str
) -> None:
    """20,000 calls parsed at once: a search from the start of the text for each would take
    minutes."""
    text = ("Next. " + opening + closing) * 20_000
    start = time.perf_counter()
    out = parser.parse(text)
    assert time.perf_counter() - start < 20
    assert len(out.tool_calls) == 20_000 and out.errors == []


def test_feeding_after_finish_is_refused_and_finish_is_idempotent() -> None:
    stream = HermesToolParser().stream()
    stream.feed("hi <tool_call>")
    delta, parsed = stream.finish()
    assert delta.content == "" and parsed.errors
    again = stream.finish()
    assert again[1] is parsed and again[0].content == "" and not again[0].tool_calls
    with pytest.raises(RuntimeError, match="new stream"):
        stream.feed("more")
