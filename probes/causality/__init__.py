"""Causality probes: find per-token decisions (routing, token dropping, masks) that depend on
future tokens, tell structural leaks from rounding noise, and measure the train/inference
decision mismatch. See docs/causality.md."""
from trainprobes.causality.check import MODES, check, resolve_cuts
from trainprobes.causality.classify import Kind, Outputs, classify_changes

__all__ = ["check", "resolve_cuts", "MODES", "classify_changes", "Kind", "Outputs"]
