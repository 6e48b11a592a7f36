"""Benchmarks, run as ``agentroll bench NAME``; each prints one ``key=value`` result line.

One module per benchmark.  Benchmarks import the product; the product never imports them.
"""
