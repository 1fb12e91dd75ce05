"""The tools a person runs: the CLI, the benchmark, the end-to-end and self checks.

The runtime core (plugin, host pool, geometry, kernel wrapper, sizing) never
imports this package; a server loads none of it.
"""
