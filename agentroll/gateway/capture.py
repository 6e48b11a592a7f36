"""Token-exact capture of one session: which sample a call extends, or where it forks.

Invariants: a sample's tokens are its first rendered prompt, then per call the sampled ids
as sampled and the new messages rendered incrementally, so every prompt sent to the backend
is a prefix of the sample's final tokens; a call whose conversation is not a sample's
history plus new messages (edited or dropped messages, other tools, a template that
rewrites history) starts a new sample with a recorded ``Fork``, never a re-tokenisation.
Pure: no I/O, no asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from agentroll.chat import ChatTokenizer
from agentroll.errors import ChatTemplateError
from agentroll.rollout.builder import TrajectoryBuilder, common_prefix
from agentroll.types import FinishReason, Fork, Message, ToolSpec, Turn


def _tools_key(tools: Sequence[ToolSpec] | None) -> bytes:
    return msgspec.json.encode(list(tools or ()))


def same_message(ours: Message, theirs: Message) -> bool:
    """Whether the client's ``theirs`` is the message ``ours`` of a sample's history: an
    assistant reply by its text and calls (names and decoded arguments: clients re-encode
    the JSON and may renumber ids), any other message by role, content, name and call id."""
    if ours.role != theirs.role:
        return False
    if ours.role == "assistant":
        if ours.content.strip() != theirs.content.strip():
            return False
        if len(ours.tool_calls) != len(theirs.tool_calls):
            return False
        return all(
            a.name == b.name and a.arguments == b.arguments
            for a, b in zip(ours.tool_calls, theirs.tool_calls, strict=True)
        )
    return (
        ours.content == theirs.content
        and ours.tool_call_id == theirs.tool_call_id
        and (ours.name == theirs.name or ours.role != "tool")
    )


def _shared_prefix(history: Sequence[Message], messages: Sequence[Message]) -> int:
    n = 0
    for ours, theirs in zip(history, messages, strict=False):
        if not same_message(ours, theirs):
            break
        n += 1
    return n


class Sample:
    """One token sequence of a session and the conversation it holds."""

    __slots__ = (
        "builder",
        "busy",
        "ended_with_eot",
        "fork",
        "history",
        "index",
        "prompt_len",
        "tools_key",
        "turns",
    )

    def __init__(self, index: int, tools_key: bytes, fork: Fork | None) -> None:
        self.index = index
        self.builder = TrajectoryBuilder()
        self.history: list[Message] = []
        self.tools_key = tools_key
        self.prompt_len = 0
        self.turns: list[Turn] = []
        self.fork = fork
        self.ended_with_eot = True
        self.busy = False  # a call is generating on it

    @property
    def num_generated(self) -> int:
        return sum(t.gen_end - t.gen_start for t in self.turns)


class Plan(msgspec.Struct, kw_only=True):
    """Where a call generates: ``sample`` (its tokens so far are the prompt)."""

    sample: int
    gen_start: int
    fork: Fork | None = None
    appended: int = 0  # context tokens this call added (new messages, generation prompt)
    history_len: int = 0  # messages the sample held before this call


class Capture:
    """The samples of one session; ``plan`` places a call, ``record`` closes it."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.samples: list[Sample] = []
        self.calls = 0
        self.num_forks = 0
        self.mismatched_tokens = 0
        self._tools: Sequence[ToolSpec] | None = None
        self._tools_key = b""

    def plan(
        self,
        messages: list[Message],
        tools: Sequence[ToolSpec] | None,
        *,
        fresh: str | None = None,
    ) -> Plan:
        """Place a call on the sample whose history ``messages`` extends (appending the new
        messages' tokens), or fork a new sample (``fresh`` forces one, with that reason).
        Raises ``ChatTemplateError`` only when even a fresh rendering fails."""
        if tools is not self._tools or not self._tools_key:  # a session keeps its tools
            self._tools, self._tools_key = tools, _tools_key(tools)
        key = self._tools_key
        at_call = self.calls
        self.calls += 1
        best: Sample | None = None
        best_shared = -1
        reason = fresh or "history_edited"
        if fresh is None:
            for sample in reversed(self.samples):
                shared = _shared_prefix(sample.history, messages)
                extends = shared == len(sample.history) and bool(sample.history)
                if extends and sample.tools_key == key and not sample.busy:
                    new = messages[shared:]
                    try:
                        ids = self.tokenizer.continuation_ids(
                            new, ended_with_eot=sample.ended_with_eot
                        )
                    except ChatTemplateError:
                        reason = "template_rewrites"
                        best, best_shared = sample, shared
                        break
                    sample.builder.add_context(ids)
                    sample.history.extend(new)
                    sample.busy = True
                    return Plan(
                        sample=sample.index,
                        gen_start=len(sample.builder),
                        appended=len(ids),
                        history_len=shared,
                    )
                if extends and sample.tools_key != key:
                    reason = "tools_changed"
                elif extends and sample.busy and reason == "history_edited":
                    reason = "concurrent_call"  # the sample it extends is generating
                if shared > best_shared:
                    best, best_shared = sample, shared
        prompt = self.tokenizer.prompt_ids(messages, tools=tools)
        fork = None
        if best is not None:
            best_ids = best.builder.token_ids
            common = common_prefix(best_ids, prompt)
            fork = Fork(
                from_sample=best.index,
                at_call=at_call,
                reason=reason,
                common_tokens=common,
                mismatched_tokens=len(best_ids) - common,
            )
            self.num_forks += 1
            self.mismatched_tokens += fork.mismatched_tokens
        sample = Sample(len(self.samples), key, fork)
        sample.builder.add_context(prompt)
        sample.prompt_len = len(prompt)
        sample.history = list(messages)
        sample.busy = True
        self.samples.append(sample)
        return Plan(sample=sample.index, gen_start=len(prompt), fork=fork, appended=len(prompt))

    def plan_tokens(self, prompt: Sequence[int]) -> Plan:
        """Place a call given as token ids (the Completions API): on the sample whose
        tokens ``prompt`` starts with (the rest is appended as context), else a new sample
        (a fork when the session had samples)."""
        at_call = self.calls
        self.calls += 1
        best: Sample | None = None
        best_common = -1
        for sample in reversed(self.samples):
            ids = sample.builder.token_ids
            common = common_prefix(ids, prompt)
            if common == len(ids) and not sample.busy and sample.turns:
                rest = list(prompt[common:])
                sample.builder.add_context(rest)
                sample.busy = True
                return Plan(sample=sample.index, gen_start=len(prompt), appended=len(rest))
            if common > best_common:
                best, best_common = sample, common
        fork = None
        if best is not None:
            n = len(best.builder)
            fork = Fork(
                from_sample=best.index,
                at_call=at_call,
                reason="history_edited",
                common_tokens=best_common,
                mismatched_tokens=n - best_common,
            )
            self.num_forks += 1
            self.mismatched_tokens += fork.mismatched_tokens
        sample = Sample(len(self.samples), b"tokens", fork)
        sample.builder.add_context(list(prompt))
        sample.prompt_len = len(prompt)
        sample.busy = True
        self.samples.append(sample)
        return Plan(sample=sample.index, gen_start=len(prompt), fork=fork, appended=len(prompt))

    def branch(self, plan: Plan) -> Plan:
        """Another choice of the same call (``n`` > 1): a new sample holding exactly the
        tokens, history and turns ``plan``'s sample had when the call began."""
        src = self.samples[plan.sample]
        fork = Fork(
            from_sample=src.index,
            at_call=self.calls - 1,
            reason="n",
            common_tokens=plan.gen_start,
            mismatched_tokens=0,
        )
        sample = Sample(len(self.samples), src.tools_key, fork)
        b, s = sample.builder, src.builder
        b.token_ids = s.token_ids[: plan.gen_start]
        b.logprobs = s.logprobs[: plan.gen_start]
        b.mask = s.mask[: plan.gen_start]
        b.policy = s.policy[: plan.gen_start]
        b.kv = s.kv[: plan.gen_start]
        sample.history = list(src.history)
        sample.turns = [
            msgspec.structs.replace(t) for t in src.turns if t.gen_end <= plan.gen_start
        ]
        sample.prompt_len = src.prompt_len
        sample.ended_with_eot = src.ended_with_eot
        sample.busy = True
        self.samples.append(sample)
        self.num_forks += 1
        return Plan(
            sample=sample.index, gen_start=plan.gen_start, fork=fork, history_len=len(src.history)
        )

    def record(
        self,
        plan: Plan,
        reply: Message,
        *,
        finish: FinishReason,
        text: str,
        format_error: str | None,
        gen_seconds: float,
    ) -> Turn:
        """Close a call: its sampled tokens are on the sample's builder (added as they
        came); ``reply`` is the assistant message the client was given."""
        sample = self.samples[plan.sample]
        turn = Turn(
            index=len(sample.turns),
            gen_start=plan.gen_start,
            gen_end=len(sample.builder),
            env_end=len(sample.builder),
            finish_reason=finish,
            text=text,
            tool_calls=reply.tool_calls,
            format_error=format_error,
            gen_seconds=gen_seconds,
        )
        if sample.turns:  # the previous turn's reply ends where this call's prompt ends
            sample.turns[-1].env_end = plan.gen_start
        sample.turns.append(turn)
        sampled = sample.builder.token_ids[plan.gen_start :]
        sample.ended_with_eot = bool(sampled) and sampled[-1] == self.tokenizer.eot_id
        sample.history.append(reply)
        sample.busy = False
        return turn

    def discard(self, plan: Plan) -> None:
        """Undo a call that failed or was aborted before it was recorded (the client never
        saw a reply): its sampled tokens and the messages it appended go, so a retry of the
        same call extends the sample exactly as the first attempt would have; a sample the
        call created goes too."""
        sample = self.samples[plan.sample]
        sample.busy = False
        if not sample.turns and plan.sample == len(self.samples) - 1:
            self.samples.pop()
            if sample.fork is not None:
                self.num_forks -= 1
                self.mismatched_tokens -= sample.fork.mismatched_tokens
            return
        sample.builder.truncate(plan.gen_start - plan.appended)
        del sample.history[plan.history_len :]


__all__ = ["Capture", "Plan", "Sample", "same_message"]
