"""Example environments (installed as ``agentroll.environments``); one class per file."""
