from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentroll.chat import ChatTokenizer, HermesToolParser
from agentroll.errors import ChatTemplateError
from agentroll.model.tokenizer import CHAT_TEMPLATE, build_tokenizer, save_tokenizer
from agentroll.types import Message, ToolCall, ToolSpec, encode_msgpack

TOOLS = [
    ToolSpec(name="calc", description="Evaluate.", parameters={"type": "object", "properties": {}})
]
parser = HermesToolParser()

pieces = st.sampled_from(
    [
        "<|im_end|>",
        "<|im_start|>",
        "<tool_call>",
        "</tool_response>",
        "\n",
        " ",
        "  ",
        "12",
        "ab",
        "é",
        "{",
        "<",
        "|",
    ]
)
texts = st.lists(st.one_of(pieces, st.text(max_size=40)), max_size=30).map("".join)


def test_incremental_rendering_matches_full_rendering(tok: ChatTokenizer) -> None:
    msgs = [Message(role="system", content="Be brief."), Message(role="user", content="2+3?")]
    ids = tok.prompt_ids(msgs, tools=TOOLS)
    conversation = list(msgs)
    replies = [
        [
            Message(role="tool", content="5", tool_call_id="a"),
            Message(role="tool", content=" x \n", tool_call_id="b"),
        ],
        [Message(role="user", content="Are you sure?")],
        [Message(role="tool", content="", tool_call_id="c")],
    ]
    for i, reply in enumerate(replies):
        call = ToolCall(id=f"c{i}", name="calc", arguments={"e": "2+3", "i": i})
        assistant = Message(role="assistant", content=f"step {i}", tool_calls=[call])
        conversation.append(assistant)
        sampled = tok.encode(
            tok.render([*msgs, assistant])[len(tok.render(msgs)) :]
            .split("<|im_start|>assistant\n", 1)[1]
            .rstrip("\n")
        )
        ids += sampled
        ids += tok.continuation_ids(reply, ended_with_eot=sampled[-1] == tok.eot_id)
        conversation.extend(reply)
        assert tok.decode(ids, skip_special_tokens=False) == tok.render(
            conversation, tools=TOOLS, add_generation_prompt=True
        )


def test_length_truncated_turn_gets_end_of_turn_inserted(tok: ChatTokenizer) -> None:
    ids = tok.continuation_ids([Message(role="user", content="go on")], ended_with_eot=False)
    assert ids[0] == tok.eot_id
    assert ids[1:] == tok.continuation_ids(
        [Message(role="user", content="go on")], ended_with_eot=True
    )


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts)
def test_cached_encode_equals_plain_encode(tok: ChatTokenizer, text: str) -> None:
    assert tok.encode(text) == tok._encode_raw(text)
    assert tok.encode(text) == tok._encode_raw(text)  # second call served from the cache


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["tool", "user"]), texts), min_size=1, max_size=4))
def test_fast_continuation_equals_template_rendering(
    tok: ChatTokenizer, items: list[tuple[str, str]]
) -> None:
    msgs = [Message(role=r, content=c) for r, c in items]
    assert tok._render_suffix(msgs) == tok._render_suffix_slow(msgs)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts, texts, st.booleans())
def test_fast_prompt_equals_template_rendering(
    tok: ChatTokenizer, system: str, user: str, with_tools: bool
) -> None:
    msgs = [Message(role="system", content=system), Message(role="user", content=user)]
    tools = TOOLS if with_tools else None
    assert tok.render_prompt(msgs, tools=tools) == tok.render(
        msgs, tools=tools, add_generation_prompt=True
    )


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.sampled_from(["tool", "user"]), texts), min_size=1, max_size=3),
    st.lists(st.one_of(pieces, st.just("\ue0007\ue001"), st.text(max_size=10)), max_size=6),
)
def test_content_never_becomes_a_special_token(
    tok: ChatTokenizer, items: list[tuple[str, str]], extra: list[str]
) -> None:
    """A tool's output (or a task's text) holding "<|im_end|>", "<tool_call>" ... is encoded
    as text: the special tokens of the ids are the template's, as for plain contents, and
    the ids still decode to the rendering.  They were recognised before: content forged
    turn boundaries and tool calls."""
    msgs = [Message(role=r, content=c + "".join(extra)) for r, c in items]
    plain = [Message(role=r, content="x") for r, _ in items]
    special = tok.added_token_ids
    for ids, want, rendered in (
        (
            tok.continuation_ids(msgs, ended_with_eot=True),
            tok.continuation_ids(plain, ended_with_eot=True),
            tok._eot_tail + tok._render_suffix_slow(msgs),
        ),
        (
            tok.prompt_ids(msgs, tools=TOOLS),
            tok.prompt_ids(plain, tools=TOOLS),
            tok.render(msgs, tools=TOOLS, add_generation_prompt=True),
        ),
    ):
        assert [i for i in ids if i in special] == [i for i in want if i in special]
        assert tok.decode(ids, skip_special_tokens=False) == rendered


def test_template_that_transforms_content_falls_back_to_slow_path() -> None:
    trimming = CHAT_TEMPLATE.replace(
        "{{ message.content }}\n</tool_response>", "{{ message.content | trim }}\n</tool_response>"
    )
    tok = ChatTokenizer(build_tokenizer(), trimming, eot_token="<|im_end|>")
    msgs = [Message(role="tool", content="  padded  ")]
    assert "<tool_response>\npadded\n</tool_response>" in tok._render_suffix(msgs)
    assert tok._fast_shapes[("suffix", (("tool", None),))][0] is None


def test_template_that_rewrites_history_is_refused() -> None:
    # drops everything but the last two messages: the rendering does not grow by appending
    rewriting = "{% for m in messages[-2:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tok = ChatTokenizer(build_tokenizer(), rewriting, eot_token="<|im_end|>")
    with pytest.raises(ChatTemplateError, match="rewrites"):
        tok.continuation_ids([Message(role="user", content="x")], ended_with_eot=True)


def test_saved_tokenizer_loads_back(tmp_path: Path, tok: ChatTokenizer) -> None:
    save_tokenizer(tmp_path)
    loaded = ChatTokenizer.from_pretrained(tmp_path)
    text = tok.render(
        [Message(role="user", content="hello 123")], tools=TOOLS, add_generation_prompt=True
    )
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.eot_id == tok.eot_id


# -- parser ---------------------------------------------------------------------------------


def test_parses_hermes_calls() -> None:
    out = parser.parse(
        'Let me see.\n<tool_call>\n{"name": "calc", "arguments": {"e": "1+1"}}\n</tool_call>\n<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert out.content == "Let me see."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("calc", {"e": "1+1"}),
        ("f", {"a": 1}),
    ]
    assert len({c.id for c in out.tool_calls}) == 2
    assert out.errors == []


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>["calc"]</tool_call>', "JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no string 'name'"),
        ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "calc", "arguments": "nope"}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "calc", "arguments": {}}', "not closed"),
        ("text </tool_call>", "without its opening"),
        # lone surrogates: json.loads takes them, no trajectory could be encoded with them
        ('<tool_call>{"name": "calc", "arguments": {"e": "\\ud800"}}</tool_call>', "surrogate"),
        ('<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>', "surrogate"),
    ],
)
def test_malformed_calls_become_errors(text: str, fragment: str) -> None:
    out = parser.parse(text)
    assert out.tool_calls == []
    assert any(fragment in e for e in out.errors), out.errors


def test_plain_text_has_no_calls() -> None:
    out = parser.parse("  The answer is 4.  ")
    assert out.content == "The answer is 4." and not out.tool_calls and not out.errors


@settings(max_examples=500)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(
                [
                    "<tool_call>",
                    "</tool_call>",
                    '{"name": "x", "arguments": ',
                    "{",
                    "}",
                    "[",
                    '"',
                    "\\",
                    "1e999",
                    "null",
                    '"\\ud800"',
                ]
            ),
            st.text(max_size=20),
        ),
        max_size=20,
    ).map("".join)
)
def test_parser_never_crashes(text: str) -> None:
    out = parser.parse(text)
    assert isinstance(out.content, str)
    for call in out.tool_calls:
        assert isinstance(call.name, str) and isinstance(call.arguments, dict)
        encode_msgpack(call)  # every call can go into a trajectory


def test_deeply_nested_json_is_an_error_not_a_crash() -> None:
    out = parser.parse("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert out.errors and not out.tool_calls
