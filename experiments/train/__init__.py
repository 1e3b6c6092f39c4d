"""Older name of the trainer: ``python -m experiments.train`` still trains.

It runs `experiments.trainer` with the same flags; new commands should use
``python -m experiments.trainer --config configs/demo.py``. This is a
package, not a module, so that the trainer's own ``train.py`` keeps its
history as ``experiments/trainer/train.py``.
"""
