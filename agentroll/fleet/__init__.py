"""Fleets of generation replicas: routing, update strategies, Ray actors (DESIGN.md "Fleet")."""

from agentroll.fleet.replica import LocalReplica, Replica, ReplicaDown

__all__ = ["LocalReplica", "Replica", "ReplicaDown"]
