"""Detectors: each takes a target, measures, and returns a probes.result.Result.

Importing this package must stay cheap (no torch): the pytest plugin lives under it.
"""
__version__ = "0.1.0"
