"""The training loop: steps, logs, evaluation, checkpoints, signals, traces.

`TrainLoop` runs the compiled steps of a `steps.Trainable` from a `Start`
(step 0 or a restored checkpoint) to ``cfg.steps``: it logs one record per
step (`run_log`), evaluates on the held-out batches, saves checkpoints,
stops on a non-finite loss or state, and after SIGINT or SIGTERM saves and
stops.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N803, N806

import dataclasses
import datetime
import math
import os
import pathlib
import signal
import sys
import threading
import time
import typing
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from experiments.trainer import checkpointing
from experiments.trainer import config as config_lib
from experiments.trainer import config_checks
from experiments.trainer import distributed
from experiments.trainer import perf
from experiments.trainer import run_log
from experiments.trainer import steps as steps_lib
from experiments.trainer.preflight import RunPlan

# Where `--profile-steps` writes its trace, inside the run folder.
PROFILE_DIR = 'profile'


class NonFiniteError(RuntimeError):
  """The loss or the parameters became non-finite (message: one line)."""


def eval_text(record: dict[str, Any]) -> str:
  """``eval 2.1234 (3.063 bpb) at step 100`` for a record with an eval."""
  return (
    f'eval {record["eval_loss"]:.4f} ({record["eval_bpb"]:.3f} bpb) at step '
    f'{record["eval_step"]}'
  )


class StopOnSignal:
  """Turns SIGINT and SIGTERM into a request to stop after the current step.

  Installed only in the main thread. The first signal is recorded (the loop
  then saves a checkpoint and stops); a second one calls `on_again` with
  its number: the user does not want to wait for that save.
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self, on_again: Callable[[int], None]):
    self.signum: int | None = None
    self._on_again = on_again
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> 'StopOnSignal':
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc: Any) -> None:
    self._restore()

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if self.signum is None:
      self.signum = signum
    else:
      self._on_again(signum)

  def _restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    self._previous = {}


@dataclasses.dataclass
class Start:
  """Where the loop starts: step 0, or a restored checkpoint."""

  step: int = 0
  meta: dict[str, Any] | None = None
  checkpointer: checkpointing.RunCheckpointer | None = None


class Profiler:
  """Traces steps a:b of ``--profile-steps`` with `jax.profiler`."""

  def __init__(self, spec: str | None, out_dir: pathlib.Path):
    parse = config_checks.parse_profile_steps
    self.window = None if spec is None else parse(spec)
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


class TrainLoop:
  """The training loop's state: steps, logs, saves, evaluation, signals."""

  def __init__(
    self,
    cfg: config_lib.Config,
    plan: RunPlan,
    trainable: steps_lib.Trainable,
    start: Start,
  ):
    self.cfg, self.plan, self.t, self.start = cfg, plan, trainable, start
    self.out_dir = plan.out_dir
    self.done = start.step
    self.saver = start.checkpointer
    self.last_saved = start.step if start.meta is not None else None
    self.step_times: list[float] = []
    self.log = run_log.RunLog(
      self.out_dir, start.step, cfg.tensorboard, plan.topology.primary
    )
    self.eval_result: dict[str, float] = {}
    self.stop = StopOnSignal(self._abandon)
    if plan.topology.distributed:  # The watchdog's handlers stop at once.
      self.stop.SIGNALS = ()
    # The step whose checkpoint is being saved, if any.
    self.saving: int | None = None
    self.sharding = NamedSharding(
      plan.mesh, P(steps_lib.DATA_AXIS, steps_lib.SEQ_AXIS)
    )
    self.tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    devices = list(plan.mesh.devices.flat)
    self.peak, self.peak_source = perf.peak_flops(
      devices, cfg.peak_tflops, cfg.dtype
    )
    self.flops_token = perf.flops_per_token(
      trainable.num_params, cfg.num_layers, cfg.d_model, cfg.seq_len
    )
    self.profiler = Profiler(cfg.profile_steps, self.out_dir)
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
    self.saving = step
    self.saver.save(step, self.t.state, meta)
    # The next step donates the state, whose buffers the save may still read.
    self.saver.wait()
    self.saving = None
    self.last_saved = step

  def _abandon(self, signum: int) -> typing.NoReturn:
    """A second SIGINT or SIGTERM: one line, then exits at once.

    A save in progress is abandoned where it is: Orbax leaves its temporary
    folder, which the next ``--resume`` names and removes. Leaving by
    `os._exit` skips the wait for Orbax's background thread (and the
    traceback from inside it); the metrics are flushed line by line.
    """
    name = signal.Signals(signum).name
    if self.saving is not None:
      what = (
        f'abandoned the save of step {self.saving} (the next --resume '
        'removes what it wrote)'
      )
    else:
      what = 'stopped without saving'
    kept = (
      f'the newest complete checkpoint is step {self.last_saved}'
      if self.last_saved is not None
      else 'no checkpoint was saved'
    )
    sys.stdout.flush()
    sys.stderr.write(f'{name} again: {what}; {kept}\n')
    sys.stderr.flush()
    if self.plan.lock is not None:
      self.plan.lock.release()
    os._exit(128 + signum)

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
      batch = (self._place(inputs_BxL), self._place(targets_BxL))
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

  def _place(self, x_BxL: np.ndarray) -> jax.Array:
    """The global batch array; each process puts in its own shards.

    Every process reads the same corpus in the same order, so each holds
    the whole batch and contributes the slices its devices own.
    """
    if self.plan.topology.num_processes == 1:
      return jax.device_put(x_BxL, self.sharding)
    return jax.make_array_from_callback(
      x_BxL.shape, self.sharding, lambda index: x_BxL[index]
    )

  def evaluate(self) -> dict[str, float]:
    """Mean held-out loss, in nats and bits per byte, after `done` steps.

    ``eval_step`` is the number of steps done, the x of the point in
    ``loss_curve.png`` (the step whose training loss would be computed
    with the same parameters).
    """
    losses = [
      self.t.eval_step(self.t.state, *map(self._place, b))
      for b in self.plan.eval_batches
    ]
    loss = float(np.mean(jax.device_get(losses)))
    # Byte-level tokens: nats per token / ln 2 is bits per byte.
    self.eval_result = {
      'eval_loss': loss,
      'eval_bpb': loss / math.log(2),
      'eval_step': self.done,
    }
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
        distributed.raise_if_asked()
        record = self.train_one()
        done = self.done
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
          record.update(self.evaluate())
          if self.plan.topology.primary:
            bar.write(eval_text(record))
        self.log.write(record)
        self.check_finite(record)
        bar.update(1)
        bar.set_postfix(**self._postfix(record), refresh=False)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
          self.save(done)
        if self.stop.signum is not None and done < cfg.steps:
          name = signal.Signals(self.stop.signum).name
          again = 'Ctrl-C' if name == 'SIGINT' else name
          bar.write(
            f'{name}: saving a checkpoint at step {done} and stopping '
            f'({again} again abandons the save)'
          )
          self.save(done)
          break
      bar.close()
      if self.completed and (cfg.checkpoint_every or cfg.checkpoint_dir):
        self.save(self.done)

  @property
  def completed(self) -> bool:
    """Whether all ``cfg.steps`` are done."""
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
