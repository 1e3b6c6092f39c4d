"""Trains a byte-level decoder-only LM with SuperOffload, optax or device Adam.

Usage (from the repository root)::

    python -m experiments.train                        # small preset
    python -m experiments.train --optimizer optax --steps 100
    python -m experiments.train --preset tiny --data README.md

Writes ``metrics.jsonl`` (one JSON line per step) and ``config.json`` to
``--out-dir`` (default ``runs/<timestamp>``) and prints a one-line summary.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N803, N806

import dataclasses
import datetime
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from experiments import config as config_lib
from experiments import data as data_lib
from experiments import model as model_lib


def weight_decay_mask(params: Any) -> Any:
  """Selects the parameters that get weight decay.

  Matrices (linear kernels, an untied output head) are decayed; biases, norm
  scales and embeddings (including a tied output head) are not.

  Args:
    params: A pytree of parameter arrays.

  Returns:
    A pytree of bools with the structure of `params`.
  """

  def decay(path: tuple[Any, ...], leaf: Any) -> bool:
    names = [str(getattr(k, 'key', getattr(k, 'name', k))) for k in path]
    ndim = len(getattr(leaf, 'shape', ()))
    if 'blocks' in names and ndim >= 1:
      # A scanned stack (no per-block index after "blocks") has the layer as
      # its leading axis, which is not a matrix dimension.
      after = path[names.index('blocks') + 1 :]
      first = after[0] if after else None
      index = getattr(first, 'key', getattr(first, 'idx', None))
      if not isinstance(index, int):
        ndim -= 1
    return ndim >= 2 and not any('embed' in n for n in names)

  return jax.tree_util.tree_map_with_path(decay, params)


def make_schedule(cfg: config_lib.Config) -> optax.Schedule:
  """Linear warmup to `learning_rate`, then cosine decay to the floor."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=min(cfg.warmup_steps, cfg.steps),
    decay_steps=max(cfg.steps, 1),
    end_value=cfg.learning_rate * cfg.min_lr_ratio,
  )


def make_optimizer(
  cfg: config_lib.Config, learning_rate: optax.ScalarOrSchedule
) -> optax.GradientTransformation:
  """Builds the AdamW transformation selected by ``cfg.optimizer``.

  Args:
    cfg: Reads `optimizer`, `b1`, `b2`, `eps` and `weight_decay`.
    learning_rate: A float or a schedule.

  Returns:
    ``jax_superoffload.adamw`` (host or ``executor="device"``) or
    ``optax.adamw``, all with the same arguments.

  Raises:
    ValueError: If ``cfg.optimizer`` is unknown.
  """
  kwargs = dict(
    b1=cfg.b1,
    b2=cfg.b2,
    eps=cfg.eps,
    weight_decay=cfg.weight_decay,
    mask=weight_decay_mask,
  )
  if cfg.optimizer == 'optax':
    return optax.adamw(learning_rate, **kwargs)
  if cfg.optimizer in ('superoffload', 'device'):
    import jax_superoffload as superoffload

    kwargs.update(
      executor='device' if cfg.optimizer == 'device' else cfg.executor,
      clip_norm=cfg.clip_norm,
      skip_nonfinite=cfg.skip_nonfinite,
      cast=cfg.cast,
      device_buckets=cfg.device_buckets or None,
    )
    return superoffload.adamw(learning_rate, **kwargs)
  raise ValueError(
    f'unknown optimizer {cfg.optimizer!r}; one of {config_lib.OPTIMIZERS}'
  )


@nnx.jit
def train_step(
  model: model_lib.Transformer,
  optimizer: nnx.Optimizer,
  inputs_BxL: jax.Array,
  targets_BxL: jax.Array,
) -> jax.Array:
  """One AdamW step on a batch; updates `model` and `optimizer` in place.

  Returns:
    The batch loss before the update.
  """
  grad_fn = nnx.value_and_grad(model_lib.loss_fn)
  loss, grads = grad_fn(model, inputs_BxL, targets_BxL)
  # optimizer.update, keeping weight-flow weights in host memory.
  model_lib.apply_gradients(model, optimizer, grads)
  return loss


def commit_placement(*nodes: nnx.Module | nnx.Optimizer) -> None:
  """Commits every array of `nodes` to the placement it already has.

  Freshly initialized arrays are "uncommitted"; after one jitted step next to
  committed ones (SuperOffload's state is committed to pinned host memory)
  they come back committed, which changes the jit cache key and costs a
  second compilation. Committing them up front keeps it to one.

  Args:
    *nodes: NNX graph nodes (the model, the optimizer), updated in place.
  """
  state = nnx.state(nodes)
  nnx.update(
    nodes, jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
  )


def _resolve_out_dir(out_dir: str | None) -> pathlib.Path:
  """Returns `out_dir`, or a fresh ``runs/<timestamp>`` when None."""
  if out_dir is not None:
    path = pathlib.Path(out_dir)
  else:
    stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    path = pathlib.Path('runs') / stamp
  path.mkdir(parents=True, exist_ok=True)
  return path


def train(
  cfg: config_lib.Config,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Trains a model from scratch as configured.

  Args:
    cfg: The run configuration.
    log: Receives the start line and the final summary line.

  Returns:
    A summary dict: `first_loss`, `final_loss` (mean of the last
    `final_loss_window` steps), `steps`, `total_tokens`, `tokens_per_s`
    (excluding the first, compiling step), `wall_time_s`, `num_params`,
    `out_dir` and `data_state` (the iterator position after training).
  """
  if cfg.optimizer not in config_lib.OPTIMIZERS:
    raise ValueError(f'unknown optimizer {cfg.optimizer!r}')
  out_dir = _resolve_out_dir(cfg.out_dir)
  (out_dir / 'config.json').write_text(
    json.dumps(dataclasses.asdict(cfg), indent=2) + '\n'
  )

  tokens_N = data_lib.read_corpus(cfg.data, cfg.data_max_bytes)
  batches = data_lib.BatchIterator(
    tokens_N, cfg.batch_size, cfg.seq_len, seed=cfg.seed
  )
  model = model_lib.init_model(cfg)
  num_params = model_lib.count_params(model)
  schedule = make_schedule(cfg)
  optimizer = nnx.Optimizer(model, make_optimizer(cfg, schedule), wrt=nnx.Param)
  # Weight-flow: the stacked block weights move to host memory now that the
  # optimizer has been built from device copies.
  model_lib.offload_weights(model)
  commit_placement(model, optimizer)
  log(
    f'preset={cfg.preset} params={num_params:,} '
    f'corpus={len(tokens_N):,} bytes optimizer={cfg.optimizer} '
    f'steps={cfg.steps} batch={cfg.batch_size}x{cfg.seq_len} '
    f'out_dir={out_dir}'
  )

  tokens_per_step = cfg.batch_size * cfg.seq_len
  losses: list[float] = []
  timed_tokens, timed_s = 0, 0.0
  start = time.perf_counter()
  bar = tqdm(range(cfg.steps), disable=not cfg.progress, unit='step')
  with open(out_dir / 'metrics.jsonl', 'w') as metrics:
    for step in bar:
      inputs_BxL, targets_BxL = next(batches)
      t0 = time.perf_counter()
      loss = float(train_step(model, optimizer, inputs_BxL, targets_BxL))
      dt = time.perf_counter() - t0
      losses.append(loss)
      if step > 0:  # Step 0 includes compilation.
        timed_tokens += tokens_per_step
        timed_s += dt
      avg_tps = timed_tokens / timed_s if timed_s else 0.0
      record = {
        'step': step,
        'loss': loss,
        'lr': float(schedule(step)),
        'tokens_per_s': tokens_per_step / dt,
        'step_time_s': dt,
        'tokens': (step + 1) * tokens_per_step,
      }
      metrics.write(json.dumps(record) + '\n')
      metrics.flush()
      bar.set_postfix(
        loss=f'{loss:.3f}', tok_s=f'{avg_tps:,.0f}', refresh=False
      )
  bar.close()

  window = losses[-max(1, cfg.final_loss_window) :]
  summary = {
    'first_loss': losses[0] if losses else math.nan,
    'final_loss': float(np.mean(window)) if losses else math.nan,
    'steps': cfg.steps,
    'total_tokens': cfg.steps * tokens_per_step,
    'tokens_per_s': timed_tokens / timed_s if timed_s else math.nan,
    'wall_time_s': time.perf_counter() - start,
    'num_params': num_params,
    'optimizer': cfg.optimizer,
    'out_dir': str(out_dir),
    'data_state': batches.get_state(),
  }
  log(
    f'done: loss {summary["first_loss"]:.4f} -> '
    f'{summary["final_loss"]:.4f} (mean of last {len(window)}) | '
    f'steps {cfg.steps} | tokens {summary["total_tokens"]:,} | '
    f'{summary["tokens_per_s"]:,.0f} tokens/s | '
    f'{summary["wall_time_s"]:.1f}s | {out_dir}/metrics.jsonl'
  )
  return summary


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point: parses flags and trains."""
  train(config_lib.config_from_args(argv))
  return 0


if __name__ == '__main__':
  sys.exit(main())
