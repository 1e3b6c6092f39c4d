"""``python -m experiments.trainer``: trains (`experiments.trainer.train`)."""

import sys

from experiments.trainer import train

if __name__ == '__main__':
  sys.exit(train.main())
