"""Loss-curve plot of a training run (matplotlib, Agg backend, no display)."""

import math
import pathlib
from collections.abc import Sequence


def _moving_average(values: Sequence[float], window: int) -> list[float]:
  """Trailing mean over up to `window` values (shorter at the start)."""
  out, total = [], 0.0
  for i, v in enumerate(values):
    total += v
    if i >= window:
      total -= values[i - window]
    out.append(total / min(i + 1, window))
  return out


def _plot_evals(ax, evals: Sequence[tuple[int, float]]) -> None:
  """Held-out losses as markers; the last one labelled with its step."""
  evals = [(s, v) for s, v in evals if math.isfinite(v)]
  if not evals:
    return
  xs, ys = zip(*evals, strict=True)
  ax.plot(xs, ys, 'o-', color='tab:orange', lw=1.2, ms=4, label='held-out eval')
  ax.annotate(
    f'eval {ys[-1]:.3f} at step {xs[-1]}',
    (xs[-1], ys[-1]),
    textcoords='offset points',
    xytext=(-6, 12),
    ha='right',
    fontsize=8,
    color='tab:orange',
    bbox={'boxstyle': 'round,pad=0.2', 'fc': 'white', 'ec': 'none'},
  )


def plot_loss_curve(
  steps: Sequence[int],
  losses: Sequence[float],
  path: str | pathlib.Path,
  title: str = '',
  resumed_at: Sequence[int] = (),
  evals: Sequence[tuple[int, float]] = (),
) -> pathlib.Path:
  """Writes a PNG of the training loss against the step.

  Draws the per-step loss, a trailing moving average over about 4% of the
  steps (from 20 steps on), the held-out evaluations at their steps (the
  last one labelled with its value and step), and a dotted line where the
  run was resumed.

  Args:
    steps: Step numbers.
    losses: The loss of each step (non-finite values are skipped).
    path: Where to write the PNG.
    title: The plot's title.
    resumed_at: Steps at which the run was resumed from a checkpoint.
    evals: ``(step, eval loss)`` of each evaluation.

  Returns:
    `path`.
  """
  # The object API with an explicit Agg canvas: no pyplot, no GUI backend,
  # no global figure state.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  points = [
    (s, v) for s, v in zip(steps, losses, strict=True) if math.isfinite(v)
  ]
  fig = Figure(figsize=(7, 4), dpi=110)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  if points:
    xs, ys = zip(*points, strict=True)
    # Smooth over ~4% of the steps once there are enough to be noisy.
    window = max(2, len(xs) // 25) if len(xs) >= 20 else 1
    alpha, lw = (0.35, 0.8) if window > 1 else (1.0, 1.5)
    ax.plot(xs, ys, color='tab:blue', alpha=alpha, lw=lw, label='loss')
    if window > 1:
      ax.plot(
        xs,
        _moving_average(ys, window),
        color='tab:blue',
        lw=1.8,
        label=f'mean of {window} steps',
      )
  _plot_evals(ax, evals)
  for step in resumed_at:
    ax.axvline(step, color='gray', ls=':', lw=1)
  if resumed_at:
    ax.plot([], [], color='gray', ls=':', lw=1, label='resumed')
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats/token)')
  ax.set_title(title, fontsize=10)
  ax.grid(True, alpha=0.3)
  if points or evals:
    ax.legend(loc='upper right', fontsize=8)
  fig.tight_layout()
  path = pathlib.Path(path)
  fig.savefig(path)
  return path
