"""Running agentroll as a program: recipes, the rollout workers, the loop, metrics, reports.

Role: ``recipe`` parses and bounds a recipe TOML; ``worker`` (tasks to a file) and
``service`` (a recipe's episodes to the served trajectory stream) are the rollout workers;
``loop`` is ``agentroll run``; ``metrics`` and ``report`` write and read the run's trace.
This layer composes the product; nothing below it imports it.
"""
