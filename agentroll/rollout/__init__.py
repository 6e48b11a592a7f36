"""Episodes on a backend: the engine, its pause and checkpoint protocol, admission, buffer.

Role: ``engine.RolloutEngine`` runs episodes (model turns, tool calls, rewards) and assembles
their token arrays (``builder``); ``pause`` carries resume policies to backends;
``checkpoint`` saves and restores in-flight episodes; ``buffer`` and ``admission`` bound
staleness between rollout and trainer.  Nothing here knows recipes, streams or the CLI.
"""
