"""Adapters to the ecosystem's seams: TRL trainers, OpenEnv and verifiers environments.

Each adapter lives in its own module behind its extra (``[trl]``, ``[openenv]``,
``[verifiers]``) and imports the foreign package only when used, so ``import agentroll``
never needs them.  Foreign errors are translated at the adapter's boundary.
"""
