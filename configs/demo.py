"""The CPU demo (`make demo`): ~0.4M parameters, a few minutes on 2 cores.

The `Config` defaults themselves. Run it, or start from it, with::

  python -m experiments.trainer --config configs/demo.py [--config.steps=100]
"""

import ml_collections

from experiments.trainer import config_files


def get_config() -> ml_collections.ConfigDict:
  """Returns the demo config."""
  return config_files.defaults()
