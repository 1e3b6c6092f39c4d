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
``config.json``; ``metrics.jsonl`` (one strict-JSON line per step: step,
loss, lr, gradient, update and parameter norms, tokens/s, step time, MFU,
and every ``--eval-every`` steps the held-out loss and bits per byte;
non-finite values are ``null``); TensorBoard event files beside it;
``loss_curve.png``; with ``--profile-steps a:b`` a ``jax.profiler`` trace
in ``profile/``; and, once all ``--steps`` are done, ``summary.json``.

Checkpoints (Orbax; model, optimizer state in its own memory kind and
sharding, step, data position, config, checksums) go to
``--checkpoint-dir`` (default ``<out_dir>/checkpoints``) every
``--checkpoint-every`` steps, at the end when either flag is given, and
whenever SIGINT or SIGTERM arrives (after the current step; the process then
exits with 128 + the signal number). One trainer writes a checkpoint folder
at a time (a lock file names the owner). ``--resume`` continues from the
newest intact checkpoint (a damaged one is set aside, with one line saying
so), in its run folder unless ``--out-dir`` says otherwise, bit-identically
on CPU: ``--steps`` is the total, and ``metrics.jsonl`` is appended to,
after dropping the lines of steps the checkpoint does not include.

Mesh: ``--mesh-data`` x ``--mesh-seq`` devices with axes ``('data', 'seq')``;
the batch is sharded over 'data', sequences over 'seq' (Ulysses attention),
parameters are replicated, and ``--zero`` shards SuperOffload's host state
over 'data'.

Exit status: 0 when all steps are done; 2 for a configuration refused before
any compilation (one line, ``error: ...``, on stderr; nothing left on
disk); 3 when the loss or the parameters became non-finite (one ``error:``
line; the last checkpoint saved before is kept; ``--on-nonfinite continue``
goes on instead); 128 + the signal number after SIGINT or SIGTERM.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N806

import contextlib
import dataclasses
import datetime
import json
import math
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
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from experiments import checkpointing
from experiments import config as config_lib
from experiments import data as data_lib
from experiments import model as model_lib
from experiments import optim
from experiments import perf
from experiments import run_log
from experiments import steps as steps_lib

ConfigError = config_lib.ConfigError

# The trainer's building blocks, under the names its users import.
weight_decay_mask = optim.weight_decay_mask
make_schedule = optim.make_schedule
make_optimizer = optim.make_optimizer
executor_name = optim.executor_name
make_train_step = steps_lib.make_train_step
make_eval_step = steps_lib.make_eval_step
commit_placement = steps_lib.commit_placement
make_mesh = steps_lib.make_mesh
place_on_mesh = steps_lib.place_on_mesh
DATA_AXIS = steps_lib.DATA_AXIS
SEQ_AXIS = steps_lib.SEQ_AXIS

# Names of the files the trainer writes into the run folder.
METRICS_FILE = run_log.METRICS_FILE
SUMMARY_FILE = 'summary.json'
PLOT_FILE = 'loss_curve.png'
CONFIG_FILE = 'config.json'
PROFILE_DIR = 'profile'

# Exit status of a run stopped by a non-finite loss or state.
NONFINITE_EXIT = 3


class NonFiniteError(RuntimeError):
  """The loss or the parameters became non-finite (message: one line)."""


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


def _resolve_out_dir(out_dir: str | None) -> pathlib.Path:
  """Returns `out_dir`, or a fresh ``runs/<timestamp>`` when None."""
  if out_dir is not None:
    return pathlib.Path(out_dir)
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  return pathlib.Path('runs') / stamp


def _has_checkpoints(directory: pathlib.Path) -> bool:
  """Whether `directory` holds Orbax step folders (cheap; no Orbax import)."""
  return directory.is_dir() and any(
    p.is_dir() and p.name.isdigit() for p in directory.iterdir()
  )


def _uses_checkpoints(cfg: config_lib.Config) -> bool:
  """Whether the run reads or periodically writes a checkpoint folder."""
  return bool(cfg.resume or cfg.checkpoint_every or cfg.checkpoint_dir)


@dataclasses.dataclass
class _Plan:
  """What the checks before any compilation found: data and folders."""

  mesh: Mesh
  checkpoint_dir: pathlib.Path
  # The run folder; on --resume without --out-dir, the checkpoint names it.
  out_dir: pathlib.Path | None
  batches: data_lib.BatchIterator
  eval_batches: list[tuple[np.ndarray, np.ndarray]]
  corpus_bytes: int
  lock: checkpointing.FolderLock | None = None
  # Folders this run created, deepest first (removed if the start fails).
  created: list[pathlib.Path] = dataclasses.field(default_factory=list)

  def make_dirs(self, path: pathlib.Path) -> None:
    """Creates `path` and its missing parents, remembering which."""
    missing = []
    for folder in [path, *path.parents]:
      if folder.exists():
        break
      missing.append(folder)
    path.mkdir(parents=True, exist_ok=True)
    self.created[:0] = missing

  def undo(self) -> None:
    """Releases the lock and removes the folders created, if still empty."""
    if self.lock is not None:
      self.lock.release()
    for folder in self.created:
      with contextlib.suppress(OSError):
        folder.rmdir()


def _read_data(
  cfg: config_lib.Config,
) -> tuple[data_lib.BatchIterator, list[Any], int]:
  """Reads the corpus, holds out its tail and checks both parts fit the run.

  Raises:
    ConfigError: Unreadable or too small data, or a vocabulary smaller than
      the data's.
  """
  try:
    tokens_N = data_lib.read_corpus(cfg.data, cfg.data_max_bytes)
  except (OSError, ValueError) as e:
    raise ConfigError(f'data: {e}') from None
  need = int(tokens_N.max()) + 1
  if cfg.vocab_size < need:
    raise ConfigError(
      f'vocab_size ({cfg.vocab_size}) is smaller than the data needs '
      f'({need}: its largest token id is {need - 1})'
    )
  train_N, eval_M = data_lib.split_holdout(tokens_N, cfg.eval_fraction)
  try:
    batches = data_lib.BatchIterator(
      train_N, cfg.batch_size * cfg.grad_accum, cfg.seq_len, seed=cfg.seed
    )
  except ValueError as e:
    raise ConfigError(f'data: {e}') from None
  evals = data_lib.eval_batches(
    eval_M, cfg.batch_size, cfg.seq_len, cfg.eval_batches
  )
  if cfg.eval_every and not evals:
    raise ConfigError(
      f'data: the held-out {len(eval_M):,} bytes (eval_fraction '
      f'{cfg.eval_fraction}) hold less than one batch of {cfg.batch_size} x '
      f'{cfg.seq_len + 1}; raise --eval-fraction or pass --eval-every 0'
    )
  return batches, evals, len(tokens_N)


def _preflight(cfg: config_lib.Config, log: Callable[[str], None]) -> _Plan:
  """Every check that needs no compilation, in the order a user fixes them.

  Validates the config, builds the mesh, reads the data, builds the
  optimizer (its own checks), then takes the checkpoint folder's lock and
  checks the folders. Nothing is left on disk when it raises.

  Raises:
    ConfigError: For any problem, as one line.
  """
  config_lib.validate(cfg)
  if cfg.tensorboard:
    try:
      import tensorboardX  # noqa: F401 (checked here, used by run_log).
    except ImportError:
      raise ConfigError(
        '--tensorboard needs tensorboardX (pip install tensorboardX); '
        'or pass --no-tensorboard'
      ) from None
  mesh = make_mesh(cfg)
  batches, evals, corpus_bytes = _read_data(cfg)
  optim.make_optimizer(cfg, optim.make_schedule(cfg), mesh)
  out_dir = None
  if not cfg.resume:
    out_dir = _resolve_out_dir(cfg.out_dir)
  elif cfg.out_dir is not None:
    out_dir = pathlib.Path(cfg.out_dir)
  ckpt_dir = pathlib.Path(
    cfg.checkpoint_dir or pathlib.Path(cfg.out_dir or out_dir) / 'checkpoints'
  )
  plan = _Plan(mesh, ckpt_dir, out_dir, batches, evals, corpus_bytes)
  try:
    _check_folders(cfg, plan, log)
  except BaseException:
    plan.undo()
    raise
  return plan


def _check_folders(
  cfg: config_lib.Config, plan: _Plan, log: Callable[[str], None]
) -> None:
  """Locks the checkpoint folder and checks it holds what the run expects."""
  ckpt_dir = plan.checkpoint_dir
  if cfg.resume and not _has_checkpoints(ckpt_dir):
    raise ConfigError(f'--resume: no checkpoint in {ckpt_dir}')
  if _uses_checkpoints(cfg):
    try:
      plan.make_dirs(ckpt_dir)
    except OSError as e:
      raise ConfigError(
        f'checkpoint folder {ckpt_dir} is not writable: {e}'
      ) from None
    plan.lock = checkpointing.FolderLock(ckpt_dir)
    if note := plan.lock.acquire():
      log(note)
  if not cfg.resume and _has_checkpoints(ckpt_dir):
    raise ConfigError(
      f'{ckpt_dir} already holds checkpoints; pass --resume to continue '
      'from them, or choose another --checkpoint-dir'
    )
  if plan.out_dir is not None:
    _make_writable(plan, plan.out_dir)


def _make_writable(plan: _Plan, out_dir: pathlib.Path) -> None:
  """Creates the run folder and checks a file can be written there."""
  try:
    plan.make_dirs(out_dir)
    probe = out_dir / f'.write-test-{id(plan)}'
    probe.write_text('')
    probe.unlink()
  except OSError as e:
    raise ConfigError(f'run folder {out_dir} is not writable: {e}') from None


def _changed_fields(old: dict[str, Any], cfg: config_lib.Config) -> list[str]:
  """Config fields that differ from a checkpoint's, bookkeeping aside."""
  ignore = {'resume', 'out_dir', 'checkpoint_dir', 'progress'}
  return [
    f'{k}: {old.get(k)!r} -> {v!r}'
    for k, v in dataclasses.asdict(cfg).items()
    if k not in ignore and k in old and old[k] != v
  ]


@dataclasses.dataclass
class _Trainable:
  """The model, its optimizer, their compiled steps and their state."""

  model: model_lib.Transformer
  optimizer: nnx.Optimizer
  schedule: Callable[[int], Any]
  train_step: steps_lib.TrainStep
  eval_step: steps_lib.EvalStep
  state: nnx.State
  num_params: int


def _build(cfg: config_lib.Config, mesh: Mesh) -> _Trainable:
  """Initializes and places the model and optimizer; defines their steps."""
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
  return _Trainable(
    model=model,
    optimizer=optimizer,
    schedule=schedule,
    train_step=make_train_step(model, optimizer, mesh),
    eval_step=make_eval_step(model, optimizer, mesh),
    state=nnx.state((model, optimizer)),
    num_params=num_params,
  )


@dataclasses.dataclass
class _Start:
  """Where the loop starts: step 0, or a restored checkpoint."""

  step: int = 0
  meta: dict[str, Any] | None = None
  checkpointer: checkpointing.RunCheckpointer | None = None


def _restore(
  cfg: config_lib.Config,
  plan: _Plan,
  trainable: _Trainable,
  log: Callable[[str], None],
) -> _Start:
  """With --resume, loads the newest intact checkpoint into `trainable`.

  Also settles the run folder (the checkpoint's unless --out-dir is given)
  and positions the data iterator.

  Raises:
    ConfigError: No intact checkpoint, or one of another model.
  """
  if not cfg.resume:
    return _Start()
  fingerprint = checkpointing.model_fingerprint(cfg)

  def check_meta(meta: dict[str, Any], step: int) -> None:
    where = str(plan.checkpoint_dir / str(step))
    checkpointing.check_fingerprint(meta['fingerprint'], fingerprint, where)
    if meta['config'].get('optimizer') != cfg.optimizer:
      raise ConfigError(
        f'--resume: the checkpoint in {plan.checkpoint_dir} was trained '
        f'with --optimizer {meta["config"].get("optimizer")}, not '
        f'{cfg.optimizer}'
      )

  checkpointer = checkpointing.RunCheckpointer(
    plan.checkpoint_dir, cfg.checkpoint_keep
  )
  try:
    found = checkpointing.restore_newest_intact(
      checkpointer, trainable.state, check_meta
    )
  finally:
    checkpointer.close()
  if found.damaged:
    log(
      f'note: damaged checkpoint(s) set aside ({"; ".join(found.damaged)}); '
      f'resuming from step {found.step}'
    )
  trainable.state = found.state
  plan.batches.set_state(found.meta['data_state'])
  if plan.out_dir is None:
    out_dir = checkpointing.resolve_out_dir(
      found.meta['out_dir'], plan.checkpoint_dir
    )
    _make_writable(plan, out_dir)
    plan.out_dir = out_dir
  if changed := _changed_fields(found.meta['config'], cfg):
    log(f'note: resuming with changed settings: {"; ".join(changed)}')
  # A fresh checkpointer: the damaged steps set aside are gone from it.
  return _Start(
    found.step,
    found.meta,
    checkpointing.RunCheckpointer(plan.checkpoint_dir, cfg.checkpoint_keep),
  )


class _Profiler:
  """Traces steps a:b of ``--profile-steps`` with `jax.profiler`."""

  def __init__(self, spec: str | None, out_dir: pathlib.Path):
    self.window = None if spec is None else config_lib.parse_profile_steps(spec)
    self.path = out_dir / PROFILE_DIR
    self.active = False

  def before(self, step: int) -> None:
    """Starts the trace at step a (or at a resume inside the window)."""
    window = self.window
    if window and not self.active and window[0] <= step < window[1]:
      jax.profiler.start_trace(str(self.path))
      self.active = True

  def after(self, step: int) -> None:
    """Stops the trace once step b - 1 is done."""
    if self.active and step + 1 >= self.window[1]:
      self.close()
      self.window = None

  def close(self) -> None:
    """Stops a trace in progress (at the end of a shorter run too)."""
    if self.active:
      jax.profiler.stop_trace()
      self.active = False


class _Loop:
  """The training loop's state: steps, logs, saves, evaluation, signals."""

  def __init__(
    self,
    cfg: config_lib.Config,
    plan: _Plan,
    trainable: _Trainable,
    start: _Start,
  ):
    self.cfg, self.plan, self.t, self.start = cfg, plan, trainable, start
    self.out_dir = plan.out_dir
    self.done = start.step
    self.saver = start.checkpointer
    self.last_saved = start.step if start.meta is not None else None
    self.step_times: list[float] = []
    self.log = run_log.RunLog(self.out_dir, start.step, cfg.tensorboard)
    self.eval_result: dict[str, float] = {}
    self.stop = _StopOnSignal()
    self.sharding = NamedSharding(plan.mesh, P(DATA_AXIS, SEQ_AXIS))
    self.tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    devices = list(plan.mesh.devices.flat)
    self.peak, self.peak_source = perf.peak_flops(devices, cfg.peak_tflops)
    self.flops_token = perf.flops_per_token(
      trainable.num_params, cfg.num_layers, cfg.d_model, cfg.seq_len
    )
    self.profiler = _Profiler(cfg.profile_steps, self.out_dir)
    self._fingerprint: dict[str, Any] | None = None

  def save(self, step: int) -> None:
    """Saves checkpoint `step` (once) and waits for it to be written."""
    if step == self.last_saved:
      return
    if self.saver is None:
      self.saver = checkpointing.RunCheckpointer(
        self.plan.checkpoint_dir, self.cfg.checkpoint_keep
      )
    if self._fingerprint is None:
      self._fingerprint = checkpointing.model_fingerprint(self.cfg)
    meta = {
      'data_state': self.plan.batches.get_state(),
      'out_dir': checkpointing.relative_out_dir(
        self.out_dir, self.plan.checkpoint_dir
      ),
      'config': dataclasses.asdict(self.cfg),
      'fingerprint': self._fingerprint,
      'time': datetime.datetime.now().isoformat(timespec='seconds'),
    }
    self.saver.save(step, self.t.state, meta)
    # The next step donates the state, whose buffers the save may still read.
    self.saver.wait()
    self.last_saved = step

  def train_one(self) -> dict[str, Any]:
    """Runs one optimizer step (its micro-steps) and returns its record."""
    step = self.done
    inputs, targets = next(self.plan.batches)
    shape = (self.cfg.grad_accum, self.cfg.batch_size, self.cfg.seq_len)
    inputs_AxBxL, targets_AxBxL = inputs.reshape(shape), targets.reshape(shape)
    self.profiler.before(step)
    t0 = time.perf_counter()
    losses = []
    for inputs_BxL, targets_BxL in zip(
      inputs_AxBxL, targets_AxBxL, strict=True
    ):
      batch = jax.device_put((inputs_BxL, targets_BxL), self.sharding)
      self.t.state, metrics = self.t.train_step(self.t.state, *batch)
      losses.append(metrics['loss'])
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    values['loss'] = float(np.mean(jax.device_get(losses)))
    dt = time.perf_counter() - t0
    self.profiler.after(step)
    self.done = step + 1
    if step > self.start.step:  # This process's first step compiles.
      self.step_times.append(dt)
    record = {
      'step': step,
      **values,
      'lr': float(self.t.schedule(step)),
      'tokens_per_s': self.tokens_per_step / dt,
      'step_time_s': dt,
      'tokens': self.done * self.tokens_per_step,
      'mfu': perf.mfu(self.tokens_per_step / dt, self.flops_token, self.peak),
    }
    if step == self.start.step and self.start.meta is not None:
      record['resumed'] = True
    return record

  def evaluate(self) -> dict[str, float]:
    """Mean loss over the held-out batches, in nats and bits per byte."""
    losses = [
      self.t.eval_step(self.t.state, *jax.device_put(b, self.sharding))
      for b in self.plan.eval_batches
    ]
    loss = float(np.mean(jax.device_get(losses)))
    # Byte-level tokens: nats per token / ln 2 is bits per byte.
    self.eval_result = {'eval_loss': loss, 'eval_bpb': loss / math.log(2)}
    return self.eval_result

  def check_finite(self, record: dict[str, Any]) -> None:
    """Raises `NonFiniteError` on a non-finite loss or new parameters."""
    if self.cfg.on_nonfinite == 'continue':
      return
    bad = {
      k: record[k]
      for k in ('loss', 'param_norm')
      if not math.isfinite(record[k])
    }
    if not bad:
      return
    kept = (
      f'the last checkpoint, step {self.last_saved}, in '
      f'{self.plan.checkpoint_dir} is kept'
      if self.last_saved
      else 'no checkpoint was saved'
    )
    raise NonFiniteError(
      f'step {record["step"]}: non-finite '
      f'{", ".join(f"{k} {v}" for k, v in bad.items())}; stopped without '
      f'saving ({kept}); --on-nonfinite continue goes on regardless'
    )

  def run(self, progress: bool) -> None:
    """Trains until all steps are done or a signal asks to stop."""
    cfg = self.cfg
    bar = tqdm(
      total=cfg.steps,
      initial=min(self.done, cfg.steps),
      disable=not progress,
      unit='step',
    )
    with self.stop:
      while self.done < cfg.steps:
        record = self.train_one()
        done = self.done
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
          record.update(self.evaluate())
        self.log.write(record)
        self.check_finite(record)
        bar.update(1)
        bar.set_postfix(**self._postfix(record), refresh=False)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
          self.save(done)
        if self.stop.signum is not None and done < cfg.steps:
          name = signal.Signals(self.stop.signum).name
          bar.write(f'{name}: saving a checkpoint at step {done} and stopping')
          self.save(done)
          break
    bar.close()
    if self.completed and (cfg.checkpoint_every or cfg.checkpoint_dir):
      self.save(self.done)

  @property
  def completed(self) -> bool:
    return self.done >= self.cfg.steps

  def tokens_per_s(self) -> float:
    """Timed tokens over timed seconds (this process's compiling step out)."""
    timed_s = sum(self.step_times)
    return (
      self.tokens_per_step * len(self.step_times) / timed_s
      if timed_s
      else math.nan
    )

  def _postfix(self, record: dict[str, Any]) -> dict[str, str]:
    avg_mfu = perf.mfu(self.tokens_per_s(), self.flops_token, self.peak)
    return {
      'loss': f'{record["loss"]:.3f}',
      'tok_s': f'{self.tokens_per_s():,.0f}',
      'mfu': '?' if math.isnan(avg_mfu) else f'{100 * avg_mfu:.2f}%',
    }

  def close(self) -> None:
    """Stops the trace, closes the logs, waits for saves in flight."""
    self.profiler.close()
    self.log.close()
    if self.saver is not None:
      self.saver.close()


def _summarize(
  cfg: config_lib.Config,
  plan: _Plan,
  trainable: _Trainable,
  loop: _Loop,
  wall_s: float,
) -> dict[str, Any]:
  """The run's summary (see `train`)."""
  devices = list(plan.mesh.devices.flat)
  by_kind = perf.bytes_by_memory_kind(trainable.state, devices[0])
  num_params = trainable.num_params
  losses = [
    math.nan if r.get('loss') is None else r['loss'] for r in loop.log.records
  ]
  window = losses[-max(1, cfg.final_loss_window) :]
  stopped_by = None
  if loop.stop.signum is not None and not loop.completed:
    stopped_by = signal.Signals(loop.stop.signum).name
  tokens_per_s = loop.tokens_per_s()
  step_times = loop.step_times
  return {
    'preset': cfg.preset,
    'optimizer': cfg.optimizer,
    'executor': executor_name(cfg),
    'num_params': num_params,
    'steps': loop.done,
    'first_loss': losses[0] if losses else math.nan,
    'final_loss': float(np.mean(window)) if losses else math.nan,
    'eval_loss': loop.eval_result.get('eval_loss'),
    'eval_bpb': loop.eval_result.get('eval_bpb'),
    'tokens_per_s': tokens_per_s,
    'step_time_s_median': (
      statistics.median(step_times) if step_times else math.nan
    ),
    'mfu': perf.mfu(tokens_per_s, loop.flops_token, loop.peak),
    'host_bytes_per_param': by_kind['host'] / num_params,
    'device_bytes_per_param': by_kind['device'] / num_params,
    'wall_time_s': wall_s,
    'out_dir': str(plan.out_dir),
    'total_tokens': loop.done * loop.tokens_per_step,
    'start_step': loop.start.step,
    'completed': loop.completed,
    'stopped_by': stopped_by,
    'checkpoint_dir': str(plan.checkpoint_dir) if loop.last_saved else None,
    'data_state': plan.batches.get_state(),
  }


def _start_line(
  cfg: config_lib.Config, plan: _Plan, trainable: _Trainable, loop: _Loop
) -> str:
  peak_text = f'{loop.peak / 1e12:,.3g}' if loop.peak else '?'
  accum = f'x{cfg.grad_accum}' if cfg.grad_accum > 1 else ''
  return (
    f'preset={cfg.preset} params={trainable.num_params:,} '
    f'corpus={plan.corpus_bytes:,} bytes optimizer={cfg.optimizer} '
    f'steps={cfg.steps} batch={cfg.batch_size}{accum}x{cfg.seq_len} '
    f'mesh={cfg.mesh_data}x{cfg.mesh_seq}{" zero" if cfg.zero else ""} '
    f'peak={peak_text} TFLOP/s ({loop.peak_source}) out_dir={plan.out_dir}'
  )


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
    steps), `eval_loss` and `eval_bpb` (the last evaluation, or None),
    `tokens_per_s` (this process, its first, compiling step left out),
    `step_time_s_median` (likewise), `mfu`, `host_bytes_per_param` and
    `device_bytes_per_param` (params and optimizer state held by the first
    device, by memory kind), `wall_time_s`, `out_dir`, and also
    `total_tokens`, `start_step`, `completed`, `stopped_by` (the signal
    name, or None), `checkpoint_dir` and `data_state` (the iterator
    position after training).

  Raises:
    ConfigError: For a bad configuration, before any compilation.
    NonFiniteError: When the loss or the parameters became non-finite and
      ``cfg.on_nonfinite`` is "stop".
  """
  wall_start = time.perf_counter()
  plan = _preflight(cfg, log)
  try:
    trainable = _build(cfg, plan.mesh)
    start = _restore(cfg, plan, trainable, log)
  except BaseException:
    plan.undo()
    raise
  try:
    return _train_from(cfg, plan, trainable, start, log, wall_start)
  finally:
    if plan.lock is not None:
      plan.lock.release()


def _train_from(
  cfg: config_lib.Config,
  plan: _Plan,
  trainable: _Trainable,
  start: _Start,
  log: Callable[[str], None],
  wall_start: float,
) -> dict[str, Any]:
  """Opens the run folder's logs, trains, and writes the summary."""
  out_dir = plan.out_dir
  (out_dir / CONFIG_FILE).write_text(
    json.dumps(dataclasses.asdict(cfg), indent=2) + '\n'
  )
  (out_dir / SUMMARY_FILE).unlink(missing_ok=True)  # Stale once resumed.
  loop = _Loop(cfg, plan, trainable, start)
  log(_start_line(cfg, plan, trainable, loop))
  if start.step:
    log(f'resumed from {plan.checkpoint_dir} at step {start.step}')
  if loop.peak is None:
    log('note: unknown peak FLOP/s for this device; MFU needs --peak-tflops')
  try:
    loop.run(cfg.progress)
  finally:
    loop.close()
    _write_plot(cfg, out_dir)
  nnx.update((trainable.model, trainable.optimizer), trainable.state)
  summary = _summarize(
    cfg, plan, trainable, loop, time.perf_counter() - wall_start
  )
  if loop.completed:
    (out_dir / SUMMARY_FILE).write_text(
      json.dumps(run_log.json_safe(summary), indent=2) + '\n'
    )
  eval_text = ''
  if summary['eval_loss'] is not None:
    eval_text = (
      f' | eval {summary["eval_loss"]:.4f} ({summary["eval_bpb"]:.3f} bpb)'
    )
  log(
    f'{"done" if loop.completed else "stopped"}: loss '
    f'{summary["first_loss"]:.4f} -> {summary["final_loss"]:.4f} (mean of '
    f'last {min(len(loop.log.records), cfg.final_loss_window)}){eval_text} | '
    f'steps {loop.done} | tokens {summary["total_tokens"]:,} | '
    f'{summary["tokens_per_s"]:,.0f} tokens/s | mfu '
    f'{100 * summary["mfu"]:.2f}% | {summary["wall_time_s"]:.1f}s | '
    f'{loop.log.path}'
  )
  return summary


def _write_plot(cfg: config_lib.Config, out_dir: pathlib.Path) -> None:
  """Draws ``loss_curve.png`` from the whole ``metrics.jsonl``."""
  from experiments import plotting

  records = run_log.read_metrics(out_dir / METRICS_FILE, math.inf)
  plotting.plot_loss_curve(
    [r['step'] for r in records],
    [math.nan if r.get('loss') is None else r['loss'] for r in records],
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
    0 when all steps are done; 2 for a bad configuration and 3 for a run
    that went non-finite (one line ``error: ...`` on stderr each); 128 +
    the signal number when SIGINT or SIGTERM stopped the run (after saving
    a checkpoint).
  """
  try:
    summary = train(config_lib.config_from_args(argv))
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except NonFiniteError as e:
    print(f'error: {e}', file=sys.stderr)
    return NONFINITE_EXIT
  if summary['stopped_by']:
    return 128 + signal.Signals[summary['stopped_by']].value
  return 0


if __name__ == '__main__':
  sys.exit(main())
