"""Everything checked before a run compiles anything: config, data, folders.

`plan_run` validates the config, reads the corpus and holds out its tail,
builds the optimizer once (so the library's own checks run), then takes the
checkpoint folder's lock and checks the folders can be written. A refused
start raises `ConfigError` (one line) and leaves nothing on disk.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N806

import contextlib
import dataclasses
import datetime
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.sharding import Mesh

from experiments.trainer import config as config_lib
from experiments.trainer import data as data_lib
from experiments.trainer import distributed
from experiments.trainer import folder_lock
from experiments.trainer import optim
from experiments.trainer import steps as steps_lib

ConfigError = config_lib.ConfigError


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
class RunPlan:
  """What the checks before any compilation found: data and folders."""

  mesh: Mesh
  checkpoint_dir: pathlib.Path
  # The run folder; on --resume without --out-dir, the checkpoint names it.
  out_dir: pathlib.Path | None
  batches: data_lib.BatchIterator
  eval_batches: list[tuple[np.ndarray, np.ndarray]]
  corpus_bytes: int
  lock: folder_lock.FolderLock | None = None
  # This process's place in a multi-process run (process 0 writes files).
  topology: distributed.Topology = distributed.SINGLE
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


def plan_run(
  cfg: config_lib.Config,
  log: Callable[[str], None],
  topology: distributed.Topology = distributed.SINGLE,
) -> RunPlan:
  """Every check that needs no compilation, in the order a user fixes them.

  Validates the config, builds the mesh, reads the data, builds the
  optimizer (its own checks), then takes the checkpoint folder's lock and
  checks the folders. Nothing is left on disk when it raises. Over several
  processes, process 0 alone takes the lock and checks the folders (one
  job per checkpoint folder), and the others stop with its verdict.

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
  mesh = steps_lib.make_mesh(cfg)
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
  plan = RunPlan(mesh, ckpt_dir, out_dir, batches, evals, corpus_bytes)
  plan.topology = topology
  try:
    distributed.agree(
      topology, 'folders', lambda: _check_folders(cfg, plan, log)
    )
  except BaseException:
    plan.undo()
    raise
  return plan


def _check_folders(
  cfg: config_lib.Config, plan: RunPlan, log: Callable[[str], None]
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
    plan.lock = folder_lock.FolderLock(ckpt_dir)
    if note := plan.lock.acquire():
      log(note)
  if not cfg.resume and _has_checkpoints(ckpt_dir):
    raise ConfigError(
      f'{ckpt_dir} already holds checkpoints; pass --resume to continue '
      'from them, or choose another --checkpoint-dir'
    )
  if plan.out_dir is not None:
    make_writable(plan, plan.out_dir)


def make_writable(plan: RunPlan, out_dir: pathlib.Path) -> None:
  """Creates the run folder and checks a file can be written there.

  Only process 0 writes the run folder; the others leave it alone.
  """
  if not plan.topology.primary:
    return
  try:
    plan.make_dirs(out_dir)
    probe = out_dir / f'.write-test-{id(plan)}'
    probe.write_text('')
    probe.unlink()
  except OSError as e:
    raise ConfigError(f'run folder {out_dir} is not writable: {e}') from None
