"""Benchmarks: the kernel, the optimizer step, the trainer, the GPU check."""
