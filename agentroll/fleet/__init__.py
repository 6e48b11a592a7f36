"""Fleets of generation replicas: routing, update strategies, Ray actors (DESIGN.md "Fleet").

``RayReplica`` lives in ``agentroll.fleet.ray`` (imported on use: it needs ``agentroll[ray]``).
"""

from agentroll.fleet.backend import STRATEGIES, FleetBackend, FleetStats, Strategy, SyncReport
from agentroll.fleet.replica import LocalReplica, Replica, ReplicaDown
from agentroll.fleet.router import Router

__all__ = [
    "STRATEGIES",
    "FleetBackend",
    "FleetStats",
    "LocalReplica",
    "Replica",
    "ReplicaDown",
    "Router",
    "Strategy",
    "SyncReport",
]
