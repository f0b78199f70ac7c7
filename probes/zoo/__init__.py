"""The model zoo: every transformers causal LM shrunk to a tiny random model, and the map of
what the isolation, causality, batch-invariance and drift probes say about each."""
