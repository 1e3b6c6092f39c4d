r"""Trains a byte-level decoder-only LM with SuperOffload, optax or device Adam.

Usage (from the repository root)::

    python -m experiments.trainer --config configs/demo.py   # the default
    python -m experiments.trainer --config.optimizer=optax --config.steps=100
    python -m experiments.trainer --config tiny --config.data=README.md
    python -m experiments.trainer --config.steps=2000 \
        --config.checkpoint_every=100 --config.checkpoint_dir=ckpt
    python -m experiments.trainer --config.steps=2000 \
        --config.checkpoint_every=100 --config.checkpoint_dir=ckpt \
        --config.resume                # after a crash, SIGINT or SIGTERM
    python -m experiments.trainer --config tiny --config.mesh_data=2 \
        --config.mesh_seq=2

The run starts from an ml_collections config file (``--config FILE``, or a
name of ``configs/``); each ``--config.FIELD=VALUE`` overrides one field
(see `experiments.trainer.config_cli`).

Writes to the run folder (``out_dir``, default ``runs/<timestamp>``):
``config.json`` (grouped as ``--help`` groups the fields);
``metrics.jsonl`` (one strict-JSON line per step: step, loss, lr,
gradient, update and parameter norms, tokens/s, step time, MFU, and every
``eval_every`` steps the held-out loss and bits per byte;
non-finite values are ``null``); TensorBoard event files beside it;
``loss_curve.png`` (with the evaluations); with ``profile_steps`` "a:b" a
``jax.profiler`` trace in ``profile/``; and, once all ``steps`` are done,
``summary.json``.

Checkpoints (Orbax; model, optimizer state in its own memory kind and
sharding, step, data position, config, checksums) go to
``checkpoint_dir`` (default ``<out_dir>/checkpoints``) every
``checkpoint_every`` steps, at the end when either flag is given, and
whenever SIGINT or SIGTERM arrives (after the current step; the process then
exits with 128 + the signal number; a second signal abandons that save, in
one line, and the next ``resume`` names it as it removes its folder). One
trainer writes a checkpoint folder at a time (a lock file names the owner).
``resume`` continues from the newest intact checkpoint (a damaged one is set
aside, with one line saying so), in its run folder unless ``out_dir`` says
otherwise, bit-identically on CPU: ``steps`` is the total, and
``metrics.jsonl`` is appended to, after dropping the lines of steps the
checkpoint does not include.

Mesh: ``mesh_data`` x ``mesh_seq`` devices with axes ``('data', 'seq')``;
the batch is sharded over 'data', sequences over 'seq' (Ulysses attention),
parameters are replicated, and ``zero`` shards SuperOffload's host state
over 'data'.

Processes: with ``--coordinator HOST:PORT --num-processes N --process-id
I`` (or ``--distributed auto`` under SLURM and the like) the run is N
`jax.distributed` processes whose devices form one mesh; process 0 writes
the run folder and holds the checkpoint folder's lock, every process saves
its own shards, and a lost process stops the others at once (exit 4, one
line; see `experiments.trainer.supervisor`, which runs each process's
trainer as its child). SIGINT or SIGTERM stops a process of such a run at
once, without saving (one process cannot save alone).

Exit status: 0 when all steps are done; 2 for a configuration refused before
any compilation (one line, ``error: ...``, on stderr; nothing left on
disk); 3 when the loss or the parameters became non-finite (one ``error:``
line; the last checkpoint saved before is kept; ``--on-nonfinite continue``
goes on instead); 4 when another process of the run was lost; 128 + the
signal number after SIGINT or SIGTERM.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.

import dataclasses
import json
import math
import os
import pathlib
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

import jax_superoffload as superoffload
from experiments.trainer import checkpointing
from experiments.trainer import config as config_lib
from experiments.trainer import config_cli
from experiments.trainer import distributed
from experiments.trainer import loop as loop_lib
from experiments.trainer import optim
from experiments.trainer import perf
from experiments.trainer import preflight
from experiments.trainer import run_log
from experiments.trainer import steps as steps_lib
from experiments.trainer import supervisor
from experiments.trainer import switch_optimizer as switch

ConfigError = config_lib.ConfigError

# The trainer's building blocks, under the names its users import.
weight_decay_mask = optim.weight_decay_mask
make_schedule = optim.make_schedule
make_optimizer = optim.make_optimizer
executor_name = optim.executor_name
make_train_step = steps_lib.make_train_step
config_train_step = steps_lib.config_train_step
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
NonFiniteError = loop_lib.NonFiniteError

# Exit status of a run stopped by a non-finite loss or state.
NONFINITE_EXIT = 3


def _changed_fields(old: dict[str, Any], cfg: config_lib.Config) -> list[str]:
  """Config fields that differ from a checkpoint's, bookkeeping aside."""
  ignore = {
    'resume',
    'out_dir',
    'checkpoint_dir',
    'progress',
    *config_lib.field_groups()['distributed'],
  }
  return [
    f'{k}: {old.get(k)!r} -> {v!r}'
    for k, v in dataclasses.asdict(cfg).items()
    if k not in ignore and k in old and old[k] != v
  ]


def _restore(
  cfg: config_lib.Config,
  plan: preflight.RunPlan,
  trainable: steps_lib.Trainable,
  log: Callable[[str], None],
) -> loop_lib.Start:
  """With --resume, loads the newest intact checkpoint into `trainable`.

  Also settles the run folder (the checkpoint's unless --out-dir is given)
  and positions the data iterator.

  Raises:
    ConfigError: No intact checkpoint, or one of another model.
  """
  if not cfg.resume:
    return loop_lib.Start()
  fingerprint = checkpointing.model_fingerprint(cfg)
  if plan.topology.primary and (
    abandoned := checkpointing.clean_abandoned_saves(plan.checkpoint_dir)
  ):
    log(
      'note: removed the unfinished save of an interrupted run: '
      f'{"; ".join(abandoned)}'
    )
  checkpointer = checkpointing.RunCheckpointer(
    plan.checkpoint_dir, cfg.checkpoint_keep
  )
  # A checkpoint of the other optimizer (optax.adamw <-> superoffload)
  # restores into a build like its run's, then converts exactly.
  saved_build, like_optimizer = switch.saved_build(checkpointer, cfg, plan)
  like = trainable if saved_build is None else saved_build

  def check_meta(meta: dict[str, Any], step: int) -> None:
    where = str(plan.checkpoint_dir / str(step))
    checkpointing.check_fingerprint(meta['fingerprint'], fingerprint, where)
    if meta['config'].get('optimizer') != like_optimizer:
      raise ConfigError(
        f'--resume: the checkpoint in {plan.checkpoint_dir} was trained '
        f'with --optimizer {meta["config"].get("optimizer")}, not '
        f'{cfg.optimizer}'
      )

  try:
    found = checkpointing.restore_newest_intact(
      checkpointer, like.state, check_meta
    )
  finally:
    checkpointer.close()
  if found.damaged:
    log(
      f'note: damaged checkpoint(s) set aside ({"; ".join(found.damaged)}); '
      f'resuming from step {found.step}'
    )
  trainable.state = found.state
  if saved_build is not None:
    trainable.state = switch.convert(found.state, saved_build, trainable)
    log(
      f"note: converted the checkpoint's {like_optimizer} optimizer state "
      f'to {cfg.optimizer}'
    )
  plan.batches.set_state(found.meta['data_state'])
  if plan.out_dir is None:
    out_dir = checkpointing.resolve_out_dir(
      found.meta['out_dir'], plan.checkpoint_dir
    )
    preflight.make_writable(plan, out_dir)
    plan.out_dir = out_dir
  if changed := _changed_fields(found.meta['config'], cfg):
    log(f'note: resuming with changed settings: {"; ".join(changed)}')
  # A fresh checkpointer: the damaged steps set aside are gone from it.
  return loop_lib.Start(
    found.step,
    found.meta,
    checkpointing.RunCheckpointer(plan.checkpoint_dir, cfg.checkpoint_keep),
  )


def _summarize(
  cfg: config_lib.Config,
  plan: preflight.RunPlan,
  trainable: steps_lib.Trainable,
  loop: loop_lib.TrainLoop,
  wall_s: float,
) -> dict[str, Any]:
  """The run's summary (see `train`)."""
  here = jax.process_index()
  device = next(d for d in plan.mesh.devices.flat if d.process_index == here)
  by_kind = perf.bytes_by_memory_kind(trainable.state, device)
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
  last_eval = run_log.last_eval(loop.log.records) or {}
  return {
    'preset': cfg.preset,
    'optimizer': cfg.optimizer,
    'executor': executor_name(cfg),
    'num_params': num_params,
    'steps': loop.done,
    'first_loss': losses[0] if losses else math.nan,
    'final_loss': float(np.mean(window)) if losses else math.nan,
    'eval_loss': last_eval.get('eval_loss'),
    'eval_bpb': last_eval.get('eval_bpb'),
    'eval_step': last_eval.get('eval_step'),
    'tokens_per_s': tokens_per_s,
    'step_time_s_median': (
      statistics.median(step_times) if step_times else math.nan
    ),
    'mfu': perf.mfu(tokens_per_s, loop.flops_token, loop.peak),
    'peak_tflops': loop.peak / 1e12 if loop.peak else None,
    'peak_source': loop.peak_source,
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


def _zero_text(
  cfg: config_lib.Config,
  plan: preflight.RunPlan,
  trainable: steps_lib.Trainable,
) -> str:
  """The mesh text for --zero: the host state bytes it leaves whole."""
  if not cfg.zero:
    return ''
  params = nnx.state(trainable.model, nnx.Param)
  whole = superoffload.replicated_state_bytes(
    params, plan.mesh, DATA_AXIS, moments=cfg.moments
  )
  return f' zero(replicated state {whole / 2**20:,.1f} MiB/device)'


def _start_line(
  cfg: config_lib.Config,
  plan: preflight.RunPlan,
  trainable: steps_lib.Trainable,
  loop: loop_lib.TrainLoop,
) -> str:
  peak_text = f'{loop.peak / 1e12:,.3g}' if loop.peak else '?'
  accum = f'x{cfg.grad_accum}' if cfg.grad_accum > 1 else ''
  return (
    f'preset={cfg.preset} params={trainable.num_params:,} '
    f'corpus={plan.corpus_bytes:,} bytes optimizer={cfg.optimizer} '
    f'steps={cfg.steps} batch={cfg.batch_size}{accum}x{cfg.seq_len} '
    f'mesh={cfg.mesh_data}x{cfg.mesh_seq}{_zero_text(cfg, plan, trainable)} '
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
    position after training). Over several processes, process 0's is the
    run's summary (it alone prints one and writes ``summary.json``).

  Raises:
    ConfigError: For a bad configuration, before any compilation.
    NonFiniteError: When the loss or the parameters became non-finite and
      ``cfg.on_nonfinite`` is "stop".
  """
  wall_start = time.perf_counter()
  config_lib.validate(cfg)  # Before jax.distributed waits for the others.
  topology = distributed.initialize(cfg)
  watchdog = None
  if topology.distributed:
    log(
      f'process {topology.process_id} of {topology.num_processes} '
      f'(coordinator {topology.coordinator}, {jax.local_device_count()} of '
      f'{jax.device_count()} devices here)'
    )
    watchdog = distributed.Watchdog(
      topology, distributed.coordinator_host(topology), cfg.heartbeat_timeout_s
    )
  try:
    summary = _plan_and_train(cfg, topology, log, wall_start)
  except (ConfigError, NonFiniteError):  # Every process raises the same.
    if watchdog is not None:
      watchdog.close()
    raise
  # Any other exception: no goodbye, so the peers stop too.
  if watchdog is not None:
    watchdog.close()
  return summary


def _plan_and_train(
  cfg: config_lib.Config,
  topology: distributed.Topology,
  log: Callable[[str], None],
  wall_start: float,
) -> dict[str, Any]:
  """Checks the run, builds and restores it, trains it."""
  plan = preflight.plan_run(cfg, log, topology)
  try:
    trainable = steps_lib.build(cfg, plan.mesh)
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
  plan: preflight.RunPlan,
  trainable: steps_lib.Trainable,
  start: loop_lib.Start,
  log: Callable[[str], None],
  wall_start: float,
) -> dict[str, Any]:
  """Opens the run folder's logs, trains, and writes the summary."""
  out_dir = plan.out_dir
  primary = plan.topology.primary  # Only process 0 writes the run folder.
  if primary:
    (out_dir / CONFIG_FILE).write_text(
      json.dumps(config_lib.grouped(cfg), indent=2) + '\n'
    )
    (out_dir / SUMMARY_FILE).unlink(missing_ok=True)  # Stale once resumed.
  loop = loop_lib.TrainLoop(cfg, plan, trainable, start)
  # Process 0 alone prints the start and summary lines: the metrics, losses
  # and peak FLOP/s are process 0's (the others' would differ or be empty).
  if primary:
    log(_start_line(cfg, plan, trainable, loop))
  if start.step:
    log(f'resumed from {plan.checkpoint_dir} at step {start.step}')
  if loop.peak is None and primary:
    log(f'note: MFU not shown: {loop.peak_source}')
  try:
    loop.run(cfg.progress and primary)
  except BaseException:
    # Over several processes the peers stop too, and waiting here for a
    # save in flight (or its commit, which needs them) could hang.
    if not plan.topology.distributed:
      _close(loop, cfg, primary)
    raise
  _close(loop, cfg, primary)
  nnx.update((trainable.model, trainable.optimizer), trainable.state)
  summary = _summarize(
    cfg, plan, trainable, loop, time.perf_counter() - wall_start
  )
  if loop.completed and primary:
    (out_dir / SUMMARY_FILE).write_text(
      json.dumps(run_log.json_safe(summary), indent=2) + '\n'
    )
  if not primary:
    log(
      f'process {plan.topology.process_id}: '
      f'{"done" if loop.completed else "stopped"} at step {loop.done} '
      '(process 0 prints the summary)'
    )
    return summary
  log(_end_line(cfg, loop, summary))
  return summary


def _end_line(
  cfg: config_lib.Config, loop: loop_lib.TrainLoop, summary: dict[str, Any]
) -> str:
  """The ``done:`` (or ``stopped:``) line: losses, eval, speed, MFU."""
  eval_text = ''
  if summary['eval_loss'] is not None:
    eval_text = ' | ' + loop_lib.eval_text(summary)
  mfu_text = 'mfu n/a (no stated peak)'
  if summary['peak_tflops']:
    mfu_text = (
      f'mfu {100 * summary["mfu"]:.2f}% of {summary["peak_tflops"]:,.3g} '
      'TFLOP/s'
    )
  return (
    f'{"done" if loop.completed else "stopped"}: loss '
    f'{summary["first_loss"]:.4f} -> {summary["final_loss"]:.4f} (mean of '
    f'last {min(len(loop.log.records), cfg.final_loss_window)}){eval_text} | '
    f'steps {loop.done} | tokens {summary["total_tokens"]:,} | '
    f'{summary["tokens_per_s"]:,.0f} tokens/s | {mfu_text} | '
    f'{summary["wall_time_s"]:.1f}s | {loop.log.path}'
  )


def _close(
  loop: loop_lib.TrainLoop, cfg: config_lib.Config, primary: bool
) -> None:
  """Closes the loop (waits for saves) and draws the loss curve."""
  loop.close()
  if primary:
    _write_plot(cfg, loop.out_dir)


def _write_plot(cfg: config_lib.Config, out_dir: pathlib.Path) -> None:
  """Draws ``loss_curve.png`` from the whole ``metrics.jsonl``."""
  from experiments.trainer import plotting

  records = run_log.read_metrics(out_dir / METRICS_FILE, math.inf)
  evals = [
    (r.get('eval_step', r['step'] + 1), r['eval_loss'])
    for r in records
    if r.get('eval_loss') is not None
  ]
  plotting.plot_loss_curve(
    [r['step'] for r in records],
    [math.nan if r.get('loss') is None else r['loss'] for r in records],
    out_dir / PLOT_FILE,
    evals=evals,
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
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    cfg = config_lib.config_from_args(argv)
    # Once per rank: a supervisor's trainer child leaves it to the supervisor
    # (same argv); flushed, since the supervisor ends with os._exit.
    if (old := config_cli.old_flags(argv)) and not distributed.supervised():
      print(
        f'note: {", ".join(old)}: the older spelling, accepted in this '
        'release only; use --config FILE and --config.FIELD=VALUE',
        flush=True,
      )
    if distributed.wanted(cfg) and not distributed.supervised():
      config_lib.validate(cfg)  # Refused here, before any child starts.
      return supervisor.supervise(argv, cfg.heartbeat_timeout_s)
    summary = train(cfg)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except NonFiniteError as e:
    print(f'error: {e}', file=sys.stderr)
    return NONFINITE_EXIT
  except Exception:
    if distributed.supervised():  # jax's exit would wait for the peers.
      traceback.print_exc()
      sys.stderr.flush()
      os._exit(1)
    raise
  if summary['stopped_by']:
    return 128 + signal.Signals[summary['stopped_by']].value
  return 0


if __name__ == '__main__':
  sys.exit(main())
