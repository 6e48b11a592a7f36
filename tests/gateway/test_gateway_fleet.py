"""Gateway calls on a fleet: every call of a session goes to the replica that served its
first (the router's episode affinity: the session id is the episode id), and the session's
end releases it."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from gateway_helpers import TOOLS, Recorder, add_script, check_session

from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.fleet import FleetBackend, LocalReplica
from agentroll.gateway import Gateway, Session
from agentroll.gateway.wire import ChatRequest


async def test_a_session_stays_on_one_replica(tok: ChatTokenizer) -> None:
    recorders = [Recorder() for _ in range(2)]
    backends = [r.attach(MockBackend(add_script, tokenizer=tok, latency=0.01)) for r in recorders]
    replicas = [LocalReplica(b, name=f"r{i}") for i, b in enumerate(backends)]
    async with FleetBackend(replicas) as fleet, Gateway(fleet) as gw:
        sessions = [gw.open_session(task_id=f"t{i}") for i in range(6)]
        histories: dict[str, list[dict[str, Any]]] = {
            s.id: [{"role": "user", "content": f"add {i}"}] for i, s in enumerate(sessions)
        }

        async def turn(s: Session) -> None:
            body = {"messages": histories[s.id], "tools": TOOLS}
            reply = await gw.chat(s, msgspec.convert(body, ChatRequest))
            message = reply["choices"][0]["message"]
            histories[s.id].append(message)
            for call in message.get("tool_calls") or []:
                histories[s.id].append({"role": "tool", "tool_call_id": call["id"], "content": "5"})

        for _ in range(2):  # the sessions' calls at once: the router spreads first calls
            await asyncio.gather(*(turn(s) for s in sessions))
        for s in sessions:
            await gw.end(s)
        trajs = list(gw.finished)
    served = {s.id: {i for i, rec in enumerate(recorders) if rec.of(s.id)} for s in sessions}
    assert all(len(replicas_of) == 1 for replicas_of in served.values()), served
    assert len({next(iter(r)) for r in served.values()}) == 2  # both replicas got sessions
    assert len(trajs) == 6 and not any(t.forks for t in trajs)
    for t in trajs:  # token-exact on whichever replica served it
        check_session([t], [g for rec in recorders for g in rec.of(t.id)])
