"""Shared pieces of the reports: number formats, markdown tables, matplotlib.

Each benchmark owns its report (``report(data, out_dir) -> str``: markdown,
plus PNGs written to `out_dir`); `experiments.sweeps.analyze` only composes
them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use('Agg')  # Headless: reports are written to files.
import matplotlib.pyplot as plt
from matplotlib import ticker

__all__ = ['fmt', 'markdown_table', 'plt', 'ticker']


def fmt(value: Any, spec: str = ',.0f', none: str = '-') -> str:
  """Formats a number, or `none` for a missing / NaN value."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return none
  return format(value, spec)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
  """A GitHub-flavoured markdown table."""
  lines = ['| ' + ' | '.join(header) + ' |']
  lines.append('|' + '---|' * len(header))
  lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
  return '\n'.join(lines)
