"""Experiments: a byte-level decoder-only LM trainer for jax_superoffload."""
