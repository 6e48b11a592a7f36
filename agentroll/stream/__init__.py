"""Trajectory stream: rollout workers serve finished trajectories, trainers lease and ack them.

Invariants: every route of the worker's API (``stream_app``) requires a bearer token; a
trajectory is fsync'd to the spool before it is offered and leaves it only when
acknowledged, or dropped as stale into the spool's dropped segment (counted); the client
dedupes by id, so a consumer sees each trajectory exactly once.
"""

from agentroll.stream.api import serve_stream, stream_app
from agentroll.stream.auth import TOKEN_FILE, ensure_token, load_token
from agentroll.stream.client import StreamClient, StreamError
from agentroll.stream.dropped import read_dropped
from agentroll.stream.http import HTTPConfig
from agentroll.stream.server import StreamConfig, TrajectoryStream
from agentroll.stream.spool import Spool
from agentroll.stream.spool_config import SpoolConfig, SpoolRecord, SpoolStats
from agentroll.stream.wire import AckReply, AckRequest, LeaseBatch, LeaseRequest, Undecodable

__all__ = [
    "TOKEN_FILE",
    "AckReply",
    "AckRequest",
    "HTTPConfig",
    "LeaseBatch",
    "LeaseRequest",
    "Spool",
    "SpoolConfig",
    "SpoolRecord",
    "SpoolStats",
    "StreamClient",
    "StreamConfig",
    "StreamError",
    "TrajectoryStream",
    "Undecodable",
    "ensure_token",
    "load_token",
    "read_dropped",
    "serve_stream",
    "stream_app",
]
