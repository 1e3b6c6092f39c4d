"""Experiments with jax_superoffload, in packages.

`trainer` (a byte-level decoder-only LM: ``python -m experiments.trainer
--config configs/demo.py``), `benchmarks` (the kernel, the optimizer step,
the trainer, the GPU check), `sweeps` (grids of trainer runs and their
reports) and `device` (the prepared GPU command). They use only the public
API of jax_superoffload.
"""
