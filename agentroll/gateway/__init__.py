"""OpenAI-compatible gateway: outside agents' calls as token-exact, trainable episodes.

``Gateway`` keeps each session's exact tokens (``capture``), ``serve_gateway`` puts it on
HTTP (``routes``), ``AgentEnvironment`` runs an existing agent function as an environment.
"""

from agentroll.gateway.agent import AgentEnvironment, AgentFn
from agentroll.gateway.capture import Capture, Plan, Sample
from agentroll.gateway.config import GatewayConfig
from agentroll.gateway.gateway import Gateway
from agentroll.gateway.routes import GatewayApp, serve_gateway
from agentroll.gateway.session import Session
from agentroll.gateway.wire import RequestError

__all__ = [
    "AgentEnvironment",
    "AgentFn",
    "Capture",
    "Gateway",
    "GatewayApp",
    "GatewayConfig",
    "Plan",
    "RequestError",
    "Sample",
    "Session",
    "serve_gateway",
]
