"""``python -m experiments.train``: ``python -m experiments.trainer``."""

import sys

from experiments.trainer import train

if __name__ == '__main__':
  sys.exit(train.main())
