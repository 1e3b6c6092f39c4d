r"""Trains a byte-level decoder-only LM with SuperOffload, optax or device Adam.

Usage (from the repository root)::

    python -m experiments.train                        # small preset
    python -m experiments.train --optimizer optax --steps 100
    python -m experiments.train --preset tiny --data README.md
    python -m experiments.train --steps 2000 --checkpoint-every 100 \
        --checkpoint-dir ckpt
    python -m experiments.train --steps 2000 --checkpoint-every 100 \
        --checkpoint-dir ckpt --resume             # after a crash or SIGTERM
    python -m experiments.train --preset tiny --mesh-data 2 --mesh-seq 2

Writes to the run folder (``--out-dir``, default ``runs/<timestamp>``):
``config.json``, ``metrics.jsonl`` (one JSON line per step: step, loss, lr,
tokens/s, step time, MFU), ``loss_curve.png`` and, once all ``--steps`` are
done, ``summary.json``; prints a one-line summary.

Checkpoints (Orbax; model, optimizer state in its own memory kind and
sharding, step, data position, config) go to ``--checkpoint-dir`` (default
``<out_dir>/checkpoints``) every ``--checkpoint-every`` steps, at the end
when either flag is given, and whenever SIGINT or SIGTERM arrives (after the
current step; the process then exits with 128 + the signal number).
``--resume`` continues from the newest one, in its run folder unless
``--out-dir`` says otherwise, bit-identically on CPU: ``--steps`` is the
total, and ``metrics.jsonl`` is appended to, after dropping the lines of
steps the checkpoint does not include.

Mesh: ``--mesh-data`` x ``--mesh-seq`` devices with axes ``('data', 'seq')``;
the batch is sharded over 'data', sequences over 'seq' (Ulysses attention),
parameters are replicated, and ``--zero`` shards SuperOffload's host state
over 'data'.

Bad configurations stop before any work with one line, ``error: ...``, on
stderr and exit status 2.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N803, N806

import dataclasses
import datetime
import json
import math
import os
import pathlib
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from experiments import config as config_lib
from experiments import data as data_lib
from experiments import model as model_lib
from experiments import perf

ConfigError = config_lib.ConfigError

# Names of the files the trainer writes into the run folder.
METRICS_FILE = 'metrics.jsonl'
SUMMARY_FILE = 'summary.json'
PLOT_FILE = 'loss_curve.png'

# Mesh axes: the batch is sharded over the first, sequences over the second.
DATA_AXIS = 'data'
SEQ_AXIS = 'seq'


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
  warmup_steps = min(cfg.warmup_steps, cfg.steps)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=warmup_steps,
    # Runs no longer than their warmup still need one step of decay.
    decay_steps=max(cfg.steps, warmup_steps + 1),
    end_value=cfg.learning_rate * cfg.min_lr_ratio,
  )


def make_optimizer(
  cfg: config_lib.Config,
  learning_rate: optax.ScalarOrSchedule,
  mesh: Mesh | None = None,
) -> optax.GradientTransformation:
  """Builds the AdamW transformation selected by ``cfg.optimizer``.

  Args:
    cfg: Reads `optimizer`, `b1`, `b2`, `eps`, `weight_decay`, the
      SuperOffload options and `zero`.
    learning_rate: A float or a schedule.
    mesh: The training mesh; with ``cfg.zero`` SuperOffload shards its host
      state over its 'data' axis.

  Returns:
    ``jax_superoffload.adamw`` (host or ``executor="device"``) or
    ``optax.adamw``, all with the same arguments.

  Raises:
    ConfigError: If ``cfg.optimizer`` is unknown, or ``cfg.zero`` is set
      without a mesh or for optax.
  """
  kwargs = dict(
    b1=cfg.b1,
    b2=cfg.b2,
    eps=cfg.eps,
    weight_decay=cfg.weight_decay,
    mask=weight_decay_mask,
  )
  if cfg.optimizer == 'optax':
    if cfg.zero:
      raise ConfigError('--zero needs --optimizer superoffload or device')
    return optax.adamw(learning_rate, **kwargs)
  if cfg.optimizer in ('superoffload', 'device'):
    import jax_superoffload as superoffload

    kwargs.update(
      executor='device' if cfg.optimizer == 'device' else cfg.executor,
      clip_norm=cfg.clip_norm,
      skip_nonfinite=cfg.skip_nonfinite,
      cast=cfg.cast,
      device_buckets=cfg.device_buckets or None,
      bucket_bytes=(
        None if cfg.bucket_mib is None else int(cfg.bucket_mib * 2**20)
      ),
    )
    if cfg.zero:
      if mesh is None:
        raise ConfigError('--zero needs the training mesh')
      kwargs.update(mesh=mesh, shard_axis=DATA_AXIS)
    return superoffload.adamw(learning_rate, **kwargs)
  raise ConfigError(
    f'unknown optimizer {cfg.optimizer!r}; one of {config_lib.OPTIMIZERS}'
  )


def executor_name(cfg: config_lib.Config) -> str | None:
  """Where the optimizer step runs: None for optax, "auto" resolved."""
  if cfg.optimizer == 'optax':
    return None
  if cfg.optimizer == 'device':
    return 'device'
  if cfg.executor == 'auto':  # As documented by `superoffload.adam`.
    return 'ffi' if jax.default_backend() == 'cpu' else 'xla_host'
  return cfg.executor


TrainStep = Callable[
  [nnx.State, jax.Array, jax.Array], tuple[nnx.State, jax.Array]
]


def make_train_step(
  model: model_lib.Transformer,
  optimizer: nnx.Optimizer,
  mesh: Mesh,
) -> TrainStep:
  """Builds a jitted AdamW step over the state of `model` and `optimizer`.

  The step is a pure function of ``nnx.state((model, optimizer))``, jitted
  with fixed output shardings equal to its input shardings: every array
  keeps its placement (mesh, partition, memory kind) from step to step, so
  the step compiles once, parameters stay as placed (replicated), and a
  state restored with the same shardings runs the very same program. The
  state is donated: parameters and optimizer state are updated in place
  (SuperOffload's kernel writes its host buckets where they are), so the
  caller must not use the state it passed in again.

  Args:
    model: The model, placed (and committed) as it should stay.
    optimizer: Its optimizer, likewise.
    mesh: The mesh; the loss comes back replicated over it.

  Returns:
    ``step(state, inputs_BxL, targets_BxL)``, which returns the new state
    and the batch loss before the update.
  """
  graphdef, state = nnx.split((model, optimizer))
  shardings = jax.tree.map(lambda x: x.sharding, state)
  loss_sharding = NamedSharding(mesh, P())

  def step(
    state: nnx.State, inputs_BxL: jax.Array, targets_BxL: jax.Array
  ) -> tuple[nnx.State, jax.Array]:
    model, optimizer = nnx.merge(graphdef, state)
    grad_fn = nnx.value_and_grad(model_lib.loss_fn)
    loss, grads = grad_fn(model, inputs_BxL, targets_BxL)
    # optimizer.update, keeping weight-flow weights in host memory.
    model_lib.apply_gradients(model, optimizer, grads)
    return nnx.state((model, optimizer)), loss

  return jax.jit(
    step, out_shardings=(shardings, loss_sharding), donate_argnums=0
  )


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


def make_mesh(cfg: config_lib.Config) -> Mesh:
  """The ``('data', 'seq')`` mesh of the first ``mesh_data * mesh_seq`` devices.

  Raises:
    ConfigError: If fewer devices exist.
  """
  need = cfg.mesh_data * cfg.mesh_seq
  devices = jax.devices()
  if need > len(devices):
    raise ConfigError(
      f'mesh_data x mesh_seq = {cfg.mesh_data} x {cfg.mesh_seq} = {need} '
      f'devices requested, but only {len(devices)} '
      f'{devices[0].platform} device(s) exist'
    )
  grid = np.array(devices[:need]).reshape(cfg.mesh_data, cfg.mesh_seq)
  return Mesh(grid, (DATA_AXIS, SEQ_AXIS))


def place_on_mesh(mesh: Mesh, *nodes: nnx.Module | nnx.Optimizer) -> None:
  """Commits every array of `nodes` to `mesh`, in the memory it is in.

  Arrays already sharded over `mesh` (e.g. ZeRO-sharded optimizer state)
  keep their sharding; all others are replicated over it. Committing also
  keeps the train step to one compilation (see `commit_placement`).

  Args:
    mesh: The training mesh.
    *nodes: NNX graph nodes (the model, the optimizer), updated in place.
  """

  def place(x: jax.Array) -> jax.Array:
    sharding = x.sharding
    if not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
      sharding = NamedSharding(mesh, P(), memory_kind=sharding.memory_kind)
    return jax.device_put(x, sharding)

  state = nnx.state(nodes)
  nnx.update(nodes, jax.tree.map(place, state))


def _resolve_out_dir(out_dir: str | None) -> pathlib.Path:
  """Returns `out_dir`, or a fresh ``runs/<timestamp>`` when None."""
  if out_dir is not None:
    return pathlib.Path(out_dir)
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  return pathlib.Path('runs') / stamp


class _StopOnSignal:
  """Turns SIGINT and SIGTERM into a request to stop after the current step.

  Installed only in the main thread. The first signal is recorded and the
  previous handlers are put back, so a second one acts as it would have
  (SIGINT raises KeyboardInterrupt, SIGTERM terminates).
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> '_StopOnSignal':
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc: Any) -> None:
    self._restore()

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    self.signum = signum
    self._restore()

  def _restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    self._previous = {}


def _read_metrics(path: pathlib.Path, before_step: int) -> list[dict[str, Any]]:
  """The records of `path` with ``step < before_step``, in order.

  A torn last line (a process killed mid-write) and records of steps that
  the checkpoint being resumed does not include are dropped.
  """
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict) and record.get('step', math.inf) < before_step:
      records.append(record)
  return records


def _write_jsonl(path: pathlib.Path, records: list[dict[str, Any]]) -> None:
  """Replaces `path` atomically with one JSON line per record."""
  tmp = path.with_name(path.name + '.tmp')
  tmp.write_text(''.join(json.dumps(r) + '\n' for r in records))
  os.replace(tmp, path)


def _json_safe(value: Any) -> Any:
  """Maps non-finite floats to None (strict JSON), recursively."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _json_safe(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_json_safe(v) for v in value]
  return value


@dataclasses.dataclass
class _Resume:
  """Where a run starts: fresh (step 0) or from a checkpoint."""

  out_dir: pathlib.Path
  checkpoint_dir: pathlib.Path
  step: int = 0
  meta: dict[str, Any] | None = None
  checkpointer: Any = None  # A `RunCheckpointer` once one is opened.


def _has_checkpoints(directory: pathlib.Path) -> bool:
  """Whether `directory` holds Orbax step folders (cheap; no Orbax import)."""
  return directory.is_dir() and any(
    p.is_dir() and p.name.isdigit() for p in directory.iterdir()
  )


def _plan_start(cfg: config_lib.Config) -> _Resume:
  """Finds the run folder and, with ``--resume``, the checkpoint to load.

  Raises:
    ConfigError: Resuming with no checkpoint, or from a different model;
      starting afresh into a checkpoint folder that already has some.
  """
  from experiments import checkpointing

  if not cfg.resume:
    out_dir = _resolve_out_dir(cfg.out_dir)
    ckpt_dir = pathlib.Path(cfg.checkpoint_dir or out_dir / 'checkpoints')
    if _has_checkpoints(ckpt_dir):
      raise ConfigError(
        f'{ckpt_dir} already holds checkpoints; pass --resume to continue '
        'from them, or choose another --checkpoint-dir'
      )
    return _Resume(out_dir, ckpt_dir)
  ckpt_dir = pathlib.Path(
    cfg.checkpoint_dir or pathlib.Path(cfg.out_dir) / 'checkpoints'
  )
  if not _has_checkpoints(ckpt_dir):
    raise ConfigError(f'--resume: no checkpoint in {ckpt_dir}')
  checkpointer = checkpointing.RunCheckpointer(ckpt_dir, cfg.checkpoint_keep)
  step = checkpointer.latest_step()
  if step is None:
    raise ConfigError(f'--resume: no complete checkpoint in {ckpt_dir}')
  meta = checkpointer.read_meta(step)
  checkpointing.check_fingerprint(
    meta['fingerprint'],
    checkpointing.model_fingerprint(cfg),
    str(checkpointer.directory / str(step)),
  )
  if meta['config'].get('optimizer') != cfg.optimizer:
    raise ConfigError(
      f'--resume: the checkpoint in {ckpt_dir} was trained with '
      f'--optimizer {meta["config"].get("optimizer")}, not {cfg.optimizer}'
    )
  out_dir = _resolve_out_dir(cfg.out_dir or meta['out_dir'])
  return _Resume(out_dir, ckpt_dir, step, meta, checkpointer)


def _changed_fields(old: dict[str, Any], cfg: config_lib.Config) -> list[str]:
  """Config fields that differ from a checkpoint's, bookkeeping aside."""
  ignore = {'resume', 'out_dir', 'checkpoint_dir', 'progress'}
  return [
    f'{k}: {old.get(k)!r} -> {v!r}'
    for k, v in dataclasses.asdict(cfg).items()
    if k not in ignore and k in old and old[k] != v
  ]


def train(
  cfg: config_lib.Config,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Trains a model as configured, from scratch or from a checkpoint.

  Args:
    cfg: The run configuration.
    log: Receives the start line, notes and the final summary line.

  Returns:
    The summary (also written to ``summary.json`` once all steps are done):
    `preset`, `optimizer`, `executor`, `num_params`, `steps` (completed),
    `first_loss`, `final_loss` (mean of the last `final_loss_window`
    steps), `tokens_per_s` (this process, its first, compiling step left
    out), `step_time_s_median` (likewise), `mfu`, `host_bytes_per_param`
    and `device_bytes_per_param` (params and optimizer state held by the
    first device, by memory kind), `wall_time_s`, `out_dir`, and also
    `total_tokens`, `start_step`, `completed`, `stopped_by` (the signal
    name, or None), `checkpoint_dir` and `data_state` (the iterator
    position after training).

  Raises:
    ConfigError: For a bad configuration, before any training work.
  """
  wall_start = time.perf_counter()
  config_lib.validate(cfg)
  mesh = make_mesh(cfg)
  start = _plan_start(cfg)
  out_dir = start.out_dir
  out_dir.mkdir(parents=True, exist_ok=True)
  try:
    tokens_N = data_lib.read_corpus(cfg.data, cfg.data_max_bytes)
    batches = data_lib.BatchIterator(
      tokens_N, cfg.batch_size, cfg.seq_len, seed=cfg.seed
    )
  except (OSError, ValueError) as e:
    raise ConfigError(f'data: {e}') from None
  if start.meta is not None:
    batches.set_state(start.meta['data_state'])
    if changed := _changed_fields(start.meta['config'], cfg):
      log(f'note: resuming with changed settings: {"; ".join(changed)}')
  (out_dir / 'config.json').write_text(
    json.dumps(dataclasses.asdict(cfg), indent=2) + '\n'
  )
  (out_dir / SUMMARY_FILE).unlink(missing_ok=True)  # Stale once resumed.

  model = model_lib.init_model(cfg)
  num_params = model_lib.count_params(model)
  if cfg.mesh_seq > 1:
    model_lib.set_sequence_parallel(model, mesh, SEQ_AXIS, DATA_AXIS)
  # Parameters replicated over the mesh before the optimizer state is built
  # from them (ZeRO shards that state over the mesh the parameters are on).
  place_on_mesh(mesh, model)
  schedule = make_schedule(cfg)
  optimizer = nnx.Optimizer(
    model, make_optimizer(cfg, schedule, mesh), wrt=nnx.Param
  )
  # Weight-flow: the stacked block weights move to host memory now that the
  # optimizer has been built from device copies.
  model_lib.offload_weights(model)
  place_on_mesh(mesh, model, optimizer)
  train_step = make_train_step(model, optimizer, mesh)
  state = nnx.state((model, optimizer))
  if start.checkpointer is not None:
    # Same structure and placement as `state`: the same compiled step.
    state = start.checkpointer.restore(start.step, state).state

  devices = list(mesh.devices.flat)
  peak, peak_source = perf.peak_flops(devices, cfg.peak_tflops)
  flops_token = perf.flops_per_token(
    num_params, cfg.num_layers, cfg.d_model, cfg.seq_len
  )
  peak_text = f'{peak / 1e12:,.3g}' if peak else '?'
  log(
    f'preset={cfg.preset} params={num_params:,} '
    f'corpus={len(tokens_N):,} bytes optimizer={cfg.optimizer} '
    f'steps={cfg.steps} batch={cfg.batch_size}x{cfg.seq_len} '
    f'mesh={cfg.mesh_data}x{cfg.mesh_seq}{" zero" if cfg.zero else ""} '
    f'peak={peak_text} TFLOP/s ({peak_source}) out_dir={out_dir}'
  )
  if start.step:
    log(f'resumed from {start.checkpoint_dir} at step {start.step}')
  if peak is None:
    log('note: unknown peak FLOP/s for this device; MFU needs --peak-tflops')

  metrics_path = out_dir / METRICS_FILE
  records = _read_metrics(metrics_path, start.step) if start.step else []
  _write_jsonl(metrics_path, records)
  losses = [float(r['loss']) for r in records]

  saver = start.checkpointer
  last_saved = start.step if start.meta is not None else None
  fingerprint: dict[str, Any] | None = None

  def save(step: int) -> None:
    nonlocal saver, last_saved, fingerprint
    if step == last_saved:
      return
    from experiments import checkpointing

    if saver is None:
      saver = checkpointing.RunCheckpointer(
        start.checkpoint_dir, cfg.checkpoint_keep
      )
    if fingerprint is None:
      fingerprint = checkpointing.model_fingerprint(cfg)
    meta = {
      'data_state': batches.get_state(),
      'out_dir': str(out_dir.resolve()),
      'config': dataclasses.asdict(cfg),
      'fingerprint': fingerprint,
      'time': datetime.datetime.now().isoformat(timespec='seconds'),
    }
    saver.save(step, state, meta)
    # The next step donates `state`, whose buffers the save may still read.
    saver.wait()
    last_saved = step

  mesh_sharding = NamedSharding(mesh, P(DATA_AXIS, SEQ_AXIS))
  tokens_per_step = cfg.batch_size * cfg.seq_len
  step_times: list[float] = []
  done = start.step
  bar = tqdm(
    total=cfg.steps,
    initial=min(done, cfg.steps),
    disable=not cfg.progress,
    unit='step',
  )
  stop = _StopOnSignal()
  try:
    with stop, open(metrics_path, 'a') as metrics:
      while done < cfg.steps:
        step = done
        inputs_BxL, targets_BxL = jax.device_put(next(batches), mesh_sharding)
        t0 = time.perf_counter()
        state, loss = train_step(state, inputs_BxL, targets_BxL)
        loss = float(loss)
        dt = time.perf_counter() - t0
        done = step + 1
        losses.append(loss)
        if step > start.step:  # This process's first step compiles.
          step_times.append(dt)
        record = {
          'step': step,
          'loss': loss,
          'lr': float(schedule(step)),
          'tokens_per_s': tokens_per_step / dt,
          'step_time_s': dt,
          'tokens': done * tokens_per_step,
          'mfu': _json_safe(perf.mfu(tokens_per_step / dt, flops_token, peak)),
        }
        if step == start.step and start.meta is not None:
          record['resumed'] = True
        metrics.write(json.dumps(record) + '\n')
        metrics.flush()
        avg_tps = (
          tokens_per_step * len(step_times) / sum(step_times)
          if step_times
          else math.nan
        )
        avg_mfu = perf.mfu(avg_tps, flops_token, peak)
        bar.update(1)
        bar.set_postfix(
          loss=f'{loss:.3f}',
          tok_s=f'{avg_tps:,.0f}',
          mfu='?' if math.isnan(avg_mfu) else f'{100 * avg_mfu:.2f}%',
          refresh=False,
        )
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
          save(done)
        if stop.signum is not None and done < cfg.steps:
          name = signal.Signals(stop.signum).name
          bar.write(f'{name}: saving a checkpoint at step {done} and stopping')
          save(done)
          break
    bar.close()
    completed = done >= cfg.steps
    if completed and (cfg.checkpoint_every or cfg.checkpoint_dir):
      save(done)
  finally:
    if saver is not None:
      saver.close()  # Waits for the saves in flight, even on an error.

  nnx.update((model, optimizer), state)
  by_kind = perf.bytes_by_memory_kind(state, devices[0])
  timed_s = sum(step_times)
  tokens_per_s = (
    tokens_per_step * len(step_times) / timed_s if timed_s else math.nan
  )
  window = losses[-max(1, cfg.final_loss_window) :]
  stopped_by = None
  if stop.signum is not None and not completed:
    stopped_by = signal.Signals(stop.signum).name
  summary = {
    'preset': cfg.preset,
    'optimizer': cfg.optimizer,
    'executor': executor_name(cfg),
    'num_params': num_params,
    'steps': done,
    'first_loss': losses[0] if losses else math.nan,
    'final_loss': float(np.mean(window)) if losses else math.nan,
    'tokens_per_s': tokens_per_s,
    'step_time_s_median': (
      statistics.median(step_times) if step_times else math.nan
    ),
    'mfu': perf.mfu(tokens_per_s, flops_token, peak),
    'host_bytes_per_param': by_kind['host'] / num_params,
    'device_bytes_per_param': by_kind['device'] / num_params,
    'wall_time_s': time.perf_counter() - wall_start,
    'out_dir': str(out_dir),
    'total_tokens': done * tokens_per_step,
    'start_step': start.step,
    'completed': completed,
    'stopped_by': stopped_by,
    'checkpoint_dir': str(start.checkpoint_dir) if last_saved else None,
    'data_state': batches.get_state(),
  }
  _write_plot(out_dir, records_path=metrics_path, cfg=cfg)
  if completed:
    (out_dir / SUMMARY_FILE).write_text(
      json.dumps(_json_safe(summary), indent=2) + '\n'
    )
  log(
    f'{"done" if completed else "stopped"}: loss '
    f'{summary["first_loss"]:.4f} -> '
    f'{summary["final_loss"]:.4f} (mean of last {len(window)}) | '
    f'steps {done} | tokens {summary["total_tokens"]:,} | '
    f'{tokens_per_s:,.0f} tokens/s | mfu {100 * summary["mfu"]:.2f}% | '
    f'{summary["wall_time_s"]:.1f}s | {metrics_path}'
  )
  return summary


def _write_plot(
  out_dir: pathlib.Path, records_path: pathlib.Path, cfg: config_lib.Config
) -> None:
  """Draws ``loss_curve.png`` from the whole ``metrics.jsonl``."""
  from experiments import plotting

  records = _read_metrics(records_path, math.inf)
  plotting.plot_loss_curve(
    [r['step'] for r in records],
    [r['loss'] for r in records],
    out_dir / PLOT_FILE,
    title=(
      f'{cfg.preset} preset, {cfg.optimizer}, batch {cfg.batch_size}x'
      f'{cfg.seq_len}, mesh {cfg.mesh_data}x{cfg.mesh_seq}'
    ),
    resumed_at=[r['step'] for r in records if r.get('resumed')],
  )


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point: parses flags and trains.

  Returns:
    0 when all steps are done; 2 for a bad configuration (one line
    ``error: ...`` on stderr); 128 + the signal number when SIGINT or
    SIGTERM stopped the run (after saving a checkpoint).
  """
  try:
    summary = train(config_lib.config_from_args(argv))
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if summary['stopped_by']:
    return 128 + signal.Signals[summary['stopped_by']].value
  return 0


if __name__ == '__main__':
  sys.exit(main())
