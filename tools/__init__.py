"""Reusable tools (installed as ``agentroll.tools``): python exec, shell, files, calculator."""
