"""The pure ``Capture``: which sample a call extends and with which tokens, where it forks
and why (history_edited, tools_changed, template_rewrites, n), calls given as token ids,
and a discarded call whose retry gives exactly the tokens the first try would have."""

from __future__ import annotations

import numpy as np
import pytest
from gateway_helpers import ANSWER, CALL_ADD, TOOL_OUTPUT, mock_logprob, script_ids

from agentroll.chat import ChatTokenizer, HermesToolParser
from agentroll.gateway import Capture, Plan
from agentroll.model.tokenizer import build_tokenizer
from agentroll.types import Message, ToolCall, ToolSpec

TOOLS = [
    ToolSpec(
        name="add",
        description="Add two integers.",
        parameters={"type": "object", "properties": {"a": {"type": "integer"}}},
    )
]
FIRST = [Message(role="system", content="Use tools."), Message(role="user", content="2+3?")]


def generate(cap: Capture, plan: Plan, text: str, *, version: int = 0) -> Message:
    """What the gateway does for one call: the sampled ids (the MockBackend's for ``text``)
    go on the sample, the parsed reply is recorded; returns the reply."""
    builder = cap.samples[plan.sample].builder
    ids = script_ids(cap.tokenizer, text)
    start = len(builder)
    builder.add_sampled(ids, [mock_logprob(start + i) for i in range(len(ids))], version, version)
    parsed = HermesToolParser().parse(text, call_id_prefix=f"call_{cap.calls - 1}")
    reply = Message(role="assistant", content=parsed.content, tool_calls=parsed.tool_calls)
    cap.record(plan, reply, finish="stop", text=text, format_error=None, gen_seconds=0.0)
    return reply


def as_client_sends(reply: Message) -> Message:
    """The reply as a client sends it back: other call ids (clients renumber them), the
    content with other surrounding whitespace."""
    calls = [
        ToolCall(id=f"x{k}", name=c.name, arguments=dict(c.arguments))
        for k, c in enumerate(reply.tool_calls)
    ]
    return Message(role="assistant", content=f"  {reply.content}\n", tool_calls=calls)


def tool_episode(cap: Capture) -> tuple[list[Message], list[list[int]]]:
    """Two calls: a tool call, then the answer; returns the conversation and the prompts."""
    prompts = []
    plan = cap.plan(FIRST, TOOLS)
    prompts.append(cap.samples[0].builder.token_ids[: plan.gen_start].tolist())
    reply = generate(cap, plan, CALL_ADD)
    tool = Message(role="tool", content=TOOL_OUTPUT, tool_call_id="x0")
    messages = [*FIRST, as_client_sends(reply), tool]
    plan = cap.plan(messages, TOOLS)
    prompts.append(cap.samples[0].builder.token_ids[: plan.gen_start].tolist())
    messages.append(as_client_sends(generate(cap, plan, ANSWER)))
    return messages, prompts


def test_calls_that_extend_the_history_append_incrementally(tok: ChatTokenizer) -> None:
    cap = Capture(tok)
    first = cap.plan(FIRST, TOOLS)
    prompt = tok.prompt_ids(FIRST, tools=TOOLS)
    assert (first.sample, first.gen_start, first.fork) == (0, len(prompt), None)
    assert first.appended == len(prompt) and first.history_len == 0
    reply = generate(cap, first, CALL_ADD)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("add", {"a": 2, "b": 3})]
    after_first = cap.samples[0].builder.token_ids.tolist()
    assert after_first == prompt + script_ids(tok, CALL_ADD)

    tool = Message(role="tool", content=TOOL_OUTPUT, tool_call_id="x0")
    second = cap.plan([*FIRST, as_client_sends(reply), tool], TOOLS)
    context = tok.continuation_ids([tool], ended_with_eot=True)
    assert second.sample == 0 and second.fork is None and second.history_len == 3
    assert second.appended == len(context)
    assert second.gen_start == len(after_first) + len(context)
    generate(cap, second, ANSWER)

    (sample,) = cap.samples
    ids = sample.builder.token_ids.tolist()
    assert ids == after_first + context + script_ids(tok, ANSWER)
    assert [(t.gen_start, t.gen_end, t.env_end) for t in sample.turns] == [
        (first.gen_start, len(after_first), second.gen_start),
        (second.gen_start, len(ids), len(ids)),
    ]
    assert TOOL_OUTPUT in tok.decode(ids[len(after_first) : second.gen_start])
    mask = np.frombuffer(sample.builder.mask, dtype=np.uint8)
    assert mask.sum() == len(script_ids(tok, CALL_ADD)) + len(script_ids(tok, ANSWER))
    assert [m.role for m in sample.history] == ["system", "user", "assistant", "tool", "assistant"]
    assert cap.calls == 2 and cap.num_forks == 0 and cap.mismatched_tokens == 0


@pytest.mark.parametrize("edit", ["edit_user", "drop_assistant", "drop_all_but_system"])
def test_edited_history_forks_a_new_sample(tok: ChatTokenizer, edit: str) -> None:
    cap = Capture(tok)
    messages, prompts = tool_episode(cap)
    before = cap.samples[0].builder.token_ids.tolist()
    if edit == "edit_user":
        edited = [FIRST[0], Message(role="user", content="2+4?"), *messages[2:4]]
    elif edit == "drop_assistant":
        edited = messages[:4]  # the last answer left out: the same call asked again
    else:
        edited = [FIRST[0], Message(role="user", content="again")]
    plan = cap.plan(edited, TOOLS)
    fork = plan.fork
    assert fork is not None and plan.sample == 1
    assert (fork.reason, fork.from_sample, fork.at_call) == ("history_edited", 0, 2)
    fresh = tok.prompt_ids(edited, tools=TOOLS)
    assert cap.samples[1].builder.token_ids.tolist() == fresh  # a fresh rendering
    assert before[: fork.common_tokens] == fresh[: fork.common_tokens]
    assert before[fork.common_tokens] != fresh[fork.common_tokens]
    assert fork.mismatched_tokens == len(before) - fork.common_tokens > 0
    assert cap.samples[0].builder.token_ids.tolist() == before  # never rewritten
    for prompt in prompts:
        assert before[: len(prompt)] == prompt
    generate(cap, plan, ANSWER)
    assert cap.num_forks == 1 and cap.mismatched_tokens == fork.mismatched_tokens


def test_other_tools_fork_a_new_sample(tok: ChatTokenizer) -> None:
    cap = Capture(tok)
    messages, _ = tool_episode(cap)
    more = [*messages, Message(role="user", content="and 4+4?")]
    other = [ToolSpec(name="mul", description="Multiply.", parameters={"type": "object"})]
    plan = cap.plan(more, other)
    assert plan.fork is not None and plan.fork.reason == "tools_changed" and plan.sample == 1
    assert cap.samples[1].builder.token_ids.tolist() == tok.prompt_ids(more, tools=other)
    cap.discard(plan)
    same = cap.plan(more, TOOLS)  # the same tools: the sample goes on
    assert same.fork is None and same.sample == 0


REWRITING = (
    "{% for m in messages[-2:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)


def test_template_that_rewrites_history_forks(tok: ChatTokenizer) -> None:
    rewriting = ChatTokenizer(build_tokenizer(), REWRITING, eot_token="<|im_end|>")
    cap = Capture(rewriting)
    user = Message(role="user", content="hello")
    first = cap.plan([user], None)
    reply = generate(cap, first, "Hi.")
    more = [user, reply, Message(role="user", content="more")]
    plan = cap.plan(more, None)
    assert plan.fork is not None and plan.fork.reason == "template_rewrites"
    assert plan.fork.from_sample == 0 and plan.fork.mismatched_tokens > 0
    assert cap.samples[1].builder.token_ids.tolist() == rewriting.prompt_ids(more)
    generate(cap, plan, "Sure.")
    assert [len(s.turns) for s in cap.samples] == [1, 1]


def test_calls_as_token_ids(tok: ChatTokenizer) -> None:
    cap = Capture(tok)
    prompt = tok.encode("Once upon a time")
    first = cap.plan_tokens(prompt)
    assert (first.sample, first.gen_start, first.fork) == (0, len(prompt), None)
    generate(cap, first, "there was")
    so_far = cap.samples[0].builder.token_ids.tolist()
    more = tok.encode(" a gateway.")
    second = cap.plan_tokens(so_far + more)
    assert (second.sample, second.gen_start, second.appended) == (0, len(so_far + more), len(more))
    generate(cap, second, "The end.")
    whole = cap.samples[0].builder.token_ids.tolist()
    assert whole == so_far + more + script_ids(tok, "The end.")
    # a prompt that leaves the sample's tokens: a new sample, with what it shares recorded
    other = so_far[:5] + tok.encode(" else")
    third = cap.plan_tokens(other)
    assert third.fork is not None and third.sample == 1
    assert (third.fork.reason, third.fork.common_tokens) == ("history_edited", 5)
    assert third.fork.mismatched_tokens == len(whole) - 5
    assert cap.samples[1].builder.token_ids.tolist() == other
    # a prefix of the sample (its last turn dropped) forks too: those tokens were sampled
    cap.discard(third)
    fourth = cap.plan_tokens(so_far)
    assert fourth.fork is not None and fourth.fork.mismatched_tokens == len(whole) - len(so_far)


def test_branch_copies_the_sample_as_the_call_began(tok: ChatTokenizer) -> None:
    cap = Capture(tok)
    messages, _ = tool_episode(cap)
    more = [*messages, Message(role="user", content="once more")]
    plan = cap.plan(more, TOOLS)
    other = cap.branch(plan)
    fork = other.fork
    assert fork is not None and other.sample == 1 and other.gen_start == plan.gen_start
    assert (fork.reason, fork.from_sample, fork.at_call) == ("n", 0, 2)
    assert fork.common_tokens == plan.gen_start and fork.mismatched_tokens == 0
    a, b = cap.samples[0].builder, cap.samples[1].builder
    for name in ("token_ids", "mask", "policy", "kv"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist()
    np.testing.assert_array_equal(np.frombuffer(a.logprobs, "f"), np.frombuffer(b.logprobs, "f"))
    assert cap.samples[1].history == cap.samples[0].history
    assert len(cap.samples[1].turns) == 2
    generate(cap, plan, ANSWER)
    generate(cap, other, "Something else.")
    assert cap.samples[0].builder.token_ids[: plan.gen_start].tolist() == (
        cap.samples[1].builder.token_ids[: plan.gen_start].tolist()
    )
    assert [len(s.turns) for s in cap.samples] == [3, 3] and cap.num_forks == 1


def test_discarded_call_then_retry_gives_identical_tokens(tok: ChatTokenizer) -> None:
    clean, retried = Capture(tok), Capture(tok)
    for cap in (clean, retried):
        reply = generate(cap, cap.plan(FIRST, TOOLS), CALL_ADD)
    tool = Message(role="tool", content=TOOL_OUTPUT, tool_call_id="x0")
    messages = [*FIRST, as_client_sends(reply), tool]
    after_first = retried.samples[0].builder.token_ids.tolist()

    failed = retried.plan(messages, TOOLS)  # sampled a few tokens, then the client left
    builder = retried.samples[0].builder
    builder.add_sampled([5, 6, 7], [-0.1, -0.2, -0.3], 0, 0)
    retried.discard(failed)
    assert builder.token_ids.tolist() == after_first  # its context went too
    assert len(retried.samples[0].history) == 3 and not retried.samples[0].busy

    again = retried.plan(messages, TOOLS)
    assert (again.sample, again.gen_start, again.appended) == (
        failed.sample,
        failed.gen_start,
        failed.appended,
    )
    generate(retried, again, ANSWER)
    generate(clean, clean.plan(messages, TOOLS), ANSWER)
    a, b = clean.samples[0], retried.samples[0]
    for name in ("token_ids", "mask", "policy", "kv"):
        assert getattr(a.builder, name).tolist() == getattr(b.builder, name).tolist()
    np.testing.assert_array_equal(
        np.frombuffer(a.builder.logprobs, "f"), np.frombuffer(b.builder.logprobs, "f")
    )
    assert [(t.gen_start, t.gen_end, t.env_end) for t in a.turns] == [
        (t.gen_start, t.gen_end, t.env_end) for t in b.turns
    ]
    assert a.history == b.history and len(retried.samples) == 1


def test_discarded_first_call_or_fork_leaves_no_sample(tok: ChatTokenizer) -> None:
    cap = Capture(tok)
    first = cap.plan(FIRST, TOOLS)
    cap.discard(first)
    assert cap.samples == []
    messages, _ = tool_episode(cap)
    fork = cap.plan([FIRST[0], Message(role="user", content="other")], TOOLS)
    assert fork.fork is not None and cap.num_forks == 1 and cap.mismatched_tokens > 0
    cap.discard(fork)
    assert len(cap.samples) == 1 and cap.num_forks == 0 and cap.mismatched_tokens == 0
    assert cap.plan([*messages, Message(role="user", content="go")], TOOLS).sample == 0


def test_a_call_on_a_generating_sample_forks_as_concurrent(tok: ChatTokenizer) -> None:
    cap = Capture(tok)
    first = cap.plan(FIRST, TOOLS)
    reply = generate(cap, first, "Hi.")
    more = [*FIRST, as_client_sends(reply), Message(role="user", content="and 4?")]
    busy = cap.plan(more, TOOLS)  # generating: the same call again cannot extend it
    again = cap.plan(more, TOOLS)
    assert busy.fork is None and busy.sample == 0
    assert again.fork is not None and again.fork.reason == "concurrent_call"
    assert again.fork.from_sample == 0 and again.sample == 1
