"""Tiny models with known properties: a transformer LM with a training engine (full-sequence
forward) and an inference engine (KV-cache decode) in `lm`, and a small MoE transformer
block whose attention mask can be made off-by-one in `moe`."""
