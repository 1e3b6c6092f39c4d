"""The CPU demo (`make demo`): ~0.4M parameters, a few minutes on 2 cores.

The `Config` defaults themselves. Run it, or start from it, with::

  python -m experiments.trainer --config configs/demo.py [--steps 100 ...]
"""

from experiments.trainer import config


def get_config() -> config.Config:
  """Returns the demo config."""
  return config.Config()
