"""Orbax checkpoints of a training run.

A checkpoint is one Orbax step directory with two items:

* ``state``: every array of the model and the optimizer, flattened to a dict
  keyed by leaf index. Zero-size arrays (which Orbax refuses) are left out
  and taken from the freshly initialized state on restore; typed PRNG keys
  are stored as their raw key data.
* ``meta``: JSON with the step (steps completed), the data iterator's
  position, the run directory (relative to the checkpoint folder, so a
  copied run folder resumes in place), the whole config, a fingerprint of
  the model, the path, shape and dtype of every leaf of ``state`` and a
  digest of every stored array (`digests`; checkpoints written before
  them have CRC-32s of whole arrays, still verified).

Restoring verifies a checkpoint twice: Orbax's own reads (a missing or
truncated file fails there) and the digest of every restored array against
the one written at save (bytes changed in place). `restore_newest_intact`
falls back to older checkpoints past damaged ones. Checkpoints written
before SuperOffload's state held optax's `ScaleByAdamState` (one flat
NamedTuple) restore too: their leaves are found by their paths as they
were then.

One job writes a checkpoint folder at a time (`folder_lock.FolderLock`,
taken by its process 0). Over several processes (`jax.distributed`) every
process saves and restores its own shards through Orbax's multi-process
checkpointing (process 0 writes the metadata and commits the step). Each
process digests only the shards it holds, and one vote (a small
all-gather) adds the parts and tells every process whether any could not
read its shards: a step damaged on any process is rejected by all, so all
resume from the same step. The digests do not depend on the topology.

The trainer's only random stream after initialization is the data order,
whose generator is re-derived from the iterator's position (seed, epoch,
index), so that position is the whole RNG state; a typed PRNG key in the
model or optimizer state (say, for dropout) would be saved with the arrays.

Restoring places each array exactly like the corresponding array of a
freshly built state (same sharding, same memory kind), so SuperOffload's
optimizer state comes back in ``pinned_host`` memory, sharded as before.
"""

import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import threading
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import jax_superoffload as superoffload
from experiments.trainer import config as config_lib
from experiments.trainer import digests
from experiments.trainer import model as model_lib

# Model fields that may change between a checkpoint and its resumption:
# they do not change what the saved weights mean (a longer context under
# RoPE, another compute dtype, weights streamed instead of stationary).
# Fields that change parameter shapes are caught by the shape digest anyway.
_RESUMABLE_MODEL_FIELDS = frozenset(
  {'init_std', 'seq_len', 'dtype', 'weights_policy'}
)


def model_fingerprint(cfg: config_lib.Config) -> dict[str, Any]:
  """Describes the model of `cfg` for comparison with a checkpoint's.

  Args:
    cfg: The run configuration; only `model_lib.MODEL_FIELDS` are read.

  Returns:
    ``{"model": {field: value}, "params": digest}``, where the digest is a
    hash of every parameter's path, shape and dtype (from an abstract
    model; nothing is allocated).
  """
  fields = {f: getattr(cfg, f) for f in model_lib.MODEL_FIELDS}
  model_cfg = config_lib.Config(**fields)
  abstract = nnx.eval_shape(
    lambda: model_lib.Transformer(model_cfg, rngs=nnx.Rngs(0))
  )
  specs = leaf_specs(nnx.state(abstract, nnx.Param))
  digest = hashlib.sha256(json.dumps(specs).encode()).hexdigest()[:16]
  return {'model': fields, 'params': digest}


def check_fingerprint(
  saved: dict[str, Any], current: dict[str, Any], where: str
) -> None:
  """Raises a one-line `ConfigError` if `saved` is from a different model.

  Args:
    saved: The fingerprint stored in the checkpoint.
    current: The fingerprint of this run's config.
    where: The checkpoint's location, for the message.

  Raises:
    config_lib.ConfigError: If the parameter shapes differ, or a model field
      that changes what the weights mean does.
  """
  diffs = [
    f'{field}: checkpoint {saved["model"].get(field)!r}, now {value!r}'
    for field, value in current['model'].items()
    if field not in _RESUMABLE_MODEL_FIELDS
    and saved['model'].get(field) != value
  ]
  if saved['params'] != current['params'] and not diffs:
    diffs = [
      f'parameter shapes: checkpoint {saved["params"]}, now {current["params"]}'
    ]
  if diffs:
    raise config_lib.ConfigError(
      f'--resume: the checkpoint in {where} is from a different model '
      f'({"; ".join(diffs)})'
    )


def leaf_specs(tree: Any) -> list[list[Any]]:
  """``[keystr(path), shape, dtype]`` of every leaf of `tree`, in order."""
  specs = []
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    shape = [int(d) for d in np.shape(x)]
    dtype = str(getattr(x, 'dtype', type(x).__name__))
    specs.append([jax.tree_util.keystr(path), shape, dtype])
  return specs


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.prng_key
  )


def _stored(x: Any) -> bool:
  """Whether a leaf goes into the checkpoint (non-empty arrays do)."""
  return isinstance(x, (jax.Array, np.ndarray)) and np.size(x) > 0


def _key(i: int) -> str:
  return f'{i:05d}'


# Test-only: a process of a multi-process run whose environment sets this to
# a step stops inside that step's save, after writing its own shards and
# before the step is committed (Orbax's "async_write_complete" barrier, which
# process 0 must pass before it renames the temporary directory), and waits
# there until it is killed; so a kill lands mid-save for certain.
HOLD_SAVE_ENV = 'EXPERIMENTS_TEST_HOLD_SAVE_AT_STEP'


def _async_options(ocp: Any) -> Any:
  """Orbax's default async options, or those of the `HOLD_SAVE_ENV` hold."""
  hold = os.environ.get(HOLD_SAVE_ENV)
  if hold is None or jax.process_count() == 1:  # Alone, Orbax has no barrier.
    return None
  barrier = ocp.multihost.get_barrier_sync_fn()
  # The key of the barrier each process reaches once its shards of a step
  # are written ("<prefix>_async_write_complete.<step>").
  held = re.compile(rf'async_write_complete\.{int(hold)}$')

  def hold_then_barrier(*, key: str, timeout_ms: int) -> None:
    if held.search(key):
      sys.stderr.write(
        f'note: holding the save of step {hold} before its commit '
        f'({HOLD_SAVE_ENV})\n'
      )
      sys.stderr.flush()
      threading.Event().wait()
    barrier(key=key, timeout_ms=timeout_ms)

  return ocp.AsyncOptions(barrier_sync_fn=hold_then_barrier)


@dataclasses.dataclass
class Restored:
  """What `RunCheckpointer.restore` returns."""

  # The state, structured and placed like the `like` tree.
  state: Any
  # The checkpoint's JSON metadata (see `RunCheckpointer.save`).
  meta: dict[str, Any]


class RunCheckpointer:
  """Saves and restores training state with an Orbax `CheckpointManager`.

  Saves are asynchronous: `save` returns once the arrays are copied, and
  the files are written in the background. Orbax writes each step into a
  temporary directory and renames it when complete, so a process killed
  mid-save leaves the previous checkpoints intact (and the partial one is
  cleaned up by the next `RunCheckpointer` of the directory).
  """

  def __init__(self, directory: str | pathlib.Path, keep: int = 3):
    """Opens (and creates) a checkpoint directory.

    Args:
      directory: The folder of the step directories.
      keep: How many of the latest checkpoints to keep.
    """
    import orbax.checkpoint as ocp  # Slow to import; only when needed.

    self._ocp = ocp
    self.directory = pathlib.Path(directory).expanduser().resolve()
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      create=True,
      cleanup_tmp_directories=True,
      enable_async_checkpointing=True,
      async_options=_async_options(ocp),
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps of all complete checkpoints, newest first."""
    return sorted(self._manager.all_steps(), reverse=True)

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Starts saving `state` as checkpoint `step`.

    Args:
      step: The number of steps completed.
      state: A pytree of arrays (model and optimizer state).
      meta: JSON-serializable metadata; ``step`` and ``leaves`` (the leaf
        specs of `state`) are added.
    """
    leaves = jax.tree.leaves(state)
    arrays = {
      _key(i): jax.random.key_data(x) if _is_key(x) else x
      for i, x in enumerate(leaves)
      if _stored(x)
    }
    meta = {
      **meta,
      'step': step,
      'leaves': leaf_specs(state),
      'checksum_kind': digests.KIND,
      'checksums': dict(
        zip(arrays, digests.global_digests(arrays.values()), strict=True)
      ),
    }
    ocp = self._ocp
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
      ),
      force=True,
    )

  def read_meta(self, step: int) -> dict[str, Any]:
    """Reads only the JSON metadata of checkpoint `step`."""
    ocp = self._ocp
    out = self._manager.restore(
      step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
    )
    return dict(out['meta'])

  def restore(self, step: int, like: Any) -> Restored:
    """Restores checkpoint `step` into the structure and placement of `like`.

    Args:
      step: The checkpoint to read.
      like: A concrete state of the same structure (e.g. freshly
        initialized); each restored array gets its leaf's sharding, memory
        kind included. Zero-size and non-array leaves are taken from it.

    Returns:
      The restored state and the checkpoint's metadata.

    Raises:
      config_lib.ConfigError: If the checkpoint's leaves differ in path,
        shape or dtype from `like`'s.
      DamagedCheckpointError: If an array's bytes differ from those saved.
      Exception: Whatever Orbax raises for missing or unreadable files.
    """
    meta = self.read_meta(step)
    saved, now = meta['leaves'], leaf_specs(like)
    keys = _saved_keys(saved, now)
    if keys is None:
      raise config_lib.ConfigError(
        f'--resume: the checkpoint {self.directory / str(step)} does not '
        f"match this run's model and optimizer state: {_first_diff(saved, now)}"
      )
    leaves, treedef = jax.tree.flatten(like)
    target = {}
    for i, x in enumerate(leaves):
      if not _stored(x):
        continue
      data = jax.random.key_data(x) if _is_key(x) else x
      sharding = getattr(x, 'sharding', None)
      target[keys[i]] = jax.ShapeDtypeStruct(
        data.shape, data.dtype, sharding=sharding
      )
    arrays = self._read_verified(step, target, meta)
    restored = []
    for i, x in enumerate(leaves):
      if not _stored(x):
        restored.append(x)
      elif _is_key(x):
        impl = jax.random.key_impl(x)
        restored.append(jax.random.wrap_key_data(arrays[keys[i]], impl=impl))
      else:
        restored.append(arrays[keys[i]])
    return Restored(jax.tree.unflatten(treedef, restored), meta)

  def _read_verified(
    self, step: int, target: dict[str, Any], meta: dict[str, Any]
  ) -> dict[str, Any]:
    """Reads this process's shards of `step` and checks them with the others.

    Every process digests the shards it read (none is gathered) and all
    vote (a collective: every process gets here, even one whose read
    failed), so a shard damaged on any process rejects the step for all.
    """
    error, local = None, [0] * len(target)
    try:
      arrays = self._read_state(step, target)
      if meta.get('checksum_kind') == digests.KIND:
        local = [digests.local_digest(arrays[k]) for k in target]
    except Exception as e:  # Voted on below; raised after the vote.
      error = e
    if meta.get('checksum_kind') != digests.KIND:  # Written before digests.
      if error is not None:
        raise error
      digests.verify_crc32(arrays, meta.get('checksums'))
      return arrays
    sums, failed = digests.vote(local, ok=error is None)
    if error is not None:
      raise error
    if failed:
      raise DamagedCheckpointError(
        f'process(es) {failed} could not read their shards'
      )
    for key, total in zip(target, sums, strict=True):
      if meta['checksums'].get(key) != total:
        raise DamagedCheckpointError(f'array {key} fails its checksum')
    return arrays

  def _read_state(self, step: int, target: dict[str, Any]) -> dict[str, Any]:
    """Reads this process's shards of `step`, with no barrier after the read.

    `CheckpointManager.restore` ends in a barrier made of device
    collectives. A process whose read fails skips it and goes on to the
    vote, another collective, while the others wait in the barrier: their
    transports then pair two different collectives and abort the run. The
    handler alone reads without one; the vote that follows is the barrier.
    """
    ocp = self._ocp
    path = self.directory / str(step) / 'state'
    handler = ocp.StandardCheckpointHandler()
    try:
      return handler.restore(path, args=ocp.args.StandardRestore(target))
    finally:
      handler.close()

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()


def _part_pattern(part: str, fields: Sequence[str]) -> str:
  """`part` of a path (`['adam']` or `.adam`) when one of `fields` follows."""
  names = '|'.join(f for f in fields if f != 'placement')
  return rf"(?:\['{part}'\]|\.{part})(?=(?:\['|\.)(?:{names})\b)"


# The parts of a `SuperOffloadState` since it holds optax's ScaleByAdamState,
# followed by their fields: dropped, a path is as it was before.
_STATE_PARTS = re.compile(
  _part_pattern('adam', optax.ScaleByAdamState._fields)
  + '|'
  + _part_pattern('offload', superoffload.OffloadState._fields)
)


def _saved_keys(saved: list[Any], now: list[Any]) -> list[str] | None:
  """The checkpoint's key of each leaf of `now`, None if they differ.

  A checkpoint of the optimizer state's flat layout (before it held optax's
  ScaleByAdamState) holds the same arrays under paths without the state's
  two parts (and, in a Flax state, whose keys are sorted, in another
  order): each leaf is found by its path as it was then.
  """
  if saved == now:
    return [_key(i) for i in range(len(now))]
  where = {spec[0]: i for i, spec in enumerate(saved)}
  keys = []
  for path, shape, dtype in now:
    i = where.get(_STATE_PARTS.sub('', path))
    if i is None or saved[i][1:] != [shape, dtype]:
      return None
    keys.append(_key(i))
  return keys if len(set(keys)) == len(saved) else None


def _first_diff(saved: list[Any], now: list[Any]) -> str:
  """Describes the first difference of two leaf-spec lists in one line."""
  for a, b in zip(saved, now, strict=False):
    if a != b:
      return f'saved {a[0]} {a[2]}{a[1]}, now {b[0]} {b[2]}{b[1]}'
  return (
    f'saved {len(saved)} arrays, now {len(now)} (was the optimizer or one of '
    'its options changed?)'
  )


DamagedCheckpointError = digests.DamagedCheckpointError


def _one_line(error: BaseException, limit: int = 160) -> str:
  """A short one-line description of an exception."""
  text = ' '.join(str(error).split()) or type(error).__name__
  # TensorStore appends a multi-line spec dump after this phrase.
  text = text.split(' See full TensorStore details')[0]
  text = text if len(text) <= limit else text[: limit - 3] + '...'
  return f'{type(error).__name__}: {text}'


@dataclasses.dataclass
class Resumed:
  """What `restore_newest_intact` returns."""

  step: int
  state: Any
  meta: dict[str, Any]
  # One line per damaged newer checkpoint that was set aside.
  damaged: list[str]


def restore_newest_intact(
  checkpointer: RunCheckpointer,
  like: Any,
  check_meta: Callable[[dict[str, Any], int], None] = lambda meta, step: None,
) -> Resumed:
  """Restores the newest checkpoint that reads back intact.

  A damaged checkpoint (Orbax fails to read it, or an array fails its
  checksum) is moved aside to ``.damaged-<step>`` so that the run can save
  that step again, and the next older one is tried.

  Args:
    checkpointer: The run's checkpointer.
    like: The state to restore into (see `RunCheckpointer.restore`).
    check_meta: Called with each readable checkpoint's metadata and step
      before its arrays are read; raises `ConfigError` for a checkpoint of
      another model (which is not damage, so it stops the search).

  Returns:
    The step, state and metadata of the newest intact checkpoint, and a note
    per damaged one.

  Raises:
    config_lib.ConfigError: If no checkpoint is intact, or `check_meta` or
      the restore refuse one.
  """
  damaged, reasons = [], []
  for step in checkpointer.all_steps():
    try:
      meta = checkpointer.read_meta(step)
      check_meta(meta, step)
      restored = checkpointer.restore(step, like)
    except config_lib.ConfigError:
      raise
    except Exception as e:
      reasons.append(f'step {step}: {_one_line(e)}')
      damaged.append(step)
      _quiet_abandoned_reads()
      continue
    if damaged:
      if jax.process_index() == 0:
        for bad in damaged:
          _set_aside(checkpointer.directory, bad)
      _sync('experiments.checkpointing.set_aside')
    return Resumed(step, restored.state, restored.meta, reasons)
  raise config_lib.ConfigError(
    f'--resume: no intact checkpoint in {checkpointer.directory} '
    f'({"; ".join(reasons) or "none complete"})'
  )


def _sync(name: str) -> None:
  """Waits for every process to get here (nothing to wait for alone)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def _set_aside(directory: pathlib.Path, step: int) -> None:
  """Renames step folder `step` to a hidden name Orbax does not list."""
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  source = directory / str(step)
  if source.exists():
    os.replace(source, directory / f'.damaged-{step}-{stamp}')


# What Orbax's reads abandoned by a failed restore raise when they end.
_ABANDONED_READ_ERRORS = (
  'Event loop is closed',
  'Encountered error while reading array index',
)


def _quiet_abandoned_reads() -> None:
  """Drops the noise of the reads that a failed restore left behind.

  When one array of a restore fails, Orbax returns that error at once and
  closes its event loop with the other arrays' reads still pending; as they
  end or are collected, each raises "Event loop is closed" or "Encountered
  error while reading array index" into `sys.unraisablehook`, an "Exception
  ignored" traceback apiece, long after `restore_newest_intact` reported the
  damage in one line. From the first failed restore on, this process's
  hook drops those two and passes anything else on.
  """
  previous = sys.unraisablehook
  if getattr(previous, 'drops_abandoned_reads', False):
    return

  def hook(unraisable: Any) -> None:
    if str(unraisable.exc_value).startswith(_ABANDONED_READ_ERRORS):
      return
    previous(unraisable)

  hook.drops_abandoned_reads = True
  sys.unraisablehook = hook


# Orbax's temporary step folder, "<step>.orbax-checkpoint-tmp" (with a
# "-<timestamp>" suffix in some versions): a save stopped before its commit
# leaves one behind.
_ABANDONED_SAVE = re.compile(r'^(\d+)\.orbax-checkpoint-tmp')


def clean_abandoned_saves(directory: str | os.PathLike[str]) -> list[str]:
  """Removes the temporary folders of saves that never committed.

  Opening a `RunCheckpointer` removes them too, silently; this names them
  first, so a resumed run can say that a save was abandoned.

  Args:
    directory: A checkpoint folder (it may not exist).

  Returns:
    ``"step N (folder name)"`` per folder removed, by step.
  """
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return []
  found = sorted(
    (int(m.group(1)), path.name)
    for path in directory.iterdir()
    if (m := _ABANDONED_SAVE.match(path.name)) and path.is_dir()
  )
  for _, name in found:
    shutil.rmtree(directory / name)
  return [f'step {step} ({name})' for step, name in found]


def relative_out_dir(
  out_dir: pathlib.Path, checkpoint_dir: pathlib.Path
) -> str:
  """`out_dir` relative to `checkpoint_dir`, as a checkpoint stores it."""
  return os.path.relpath(out_dir.resolve(), checkpoint_dir.resolve())


def resolve_out_dir(stored: str, checkpoint_dir: pathlib.Path) -> pathlib.Path:
  """The run folder a checkpoint names (relative paths from its folder)."""
  path = pathlib.Path(stored)
  if path.is_absolute():  # Checkpoints written before relative paths.
    return path
  return pathlib.Path(os.path.normpath(checkpoint_dir / path))
