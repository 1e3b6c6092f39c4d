"""What a run writes as it goes: ``metrics.jsonl`` and TensorBoard events.

``metrics.jsonl`` holds one strict-JSON object per step (non-finite numbers
become ``null``, so any JSON parser reads it). The TensorBoard event files
(tensorboardX) sit beside it in the run folder, so ``tensorboard --logdir
runs`` shows every run.
"""

import json
import math
import os
import pathlib
from typing import Any

METRICS_FILE = 'metrics.jsonl'

# Record keys that are not curves.
_NOT_SCALARS = frozenset({'step', 'resumed', 'eval_step'})
# TensorBoard tag prefixes: eval curves apart from the training ones.
_EVAL_PREFIX = 'eval_'


def json_safe(value: Any) -> Any:
  """Maps non-finite floats to None (strict JSON), recursively."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: json_safe(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [json_safe(v) for v in value]
  return value


def dumps(value: Any) -> str:
  """Strict JSON of `value` (non-finite floats as null)."""
  return json.dumps(json_safe(value), allow_nan=False)


def read_metrics(
  path: pathlib.Path, before_step: float
) -> list[dict[str, Any]]:
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


def last_eval(records: list[dict[str, Any]]) -> dict[str, Any] | None:
  """The newest record with an evaluation, ``eval_step`` filled in.

  Records written before ``eval_step`` existed get ``step + 1``: the eval
  follows the step.
  """
  for record in reversed(records):
    if record.get('eval_loss') is not None:
      return {'eval_step': record['step'] + 1, **record}
  return None


def write_jsonl(path: pathlib.Path, records: list[dict[str, Any]]) -> None:
  """Replaces `path` atomically with one JSON line per record."""
  tmp = path.with_name(path.name + '.tmp')
  tmp.write_text(''.join(dumps(r) + '\n' for r in records))
  os.replace(tmp, path)


class RunLog:
  """Appends step records to ``metrics.jsonl`` and to TensorBoard.

  Opening it keeps the records of steps before `start_step` (a resumed run
  drops those its checkpoint does not include) and tells TensorBoard to
  discard its own events from `start_step` on.
  """

  def __init__(
    self,
    out_dir: pathlib.Path,
    start_step: int,
    tensorboard: bool,
    write_files: bool = True,
  ):
    """Opens the run folder's logs.

    Args:
      out_dir: The run folder (it exists).
      start_step: The first step this process will log.
      tensorboard: Whether to write TensorBoard event files too.
      write_files: False keeps the records in memory only (the processes
        of a multi-process run other than process 0).
    """
    self.path = out_dir / METRICS_FILE
    self._file = None
    self._writer = None
    if not write_files:
      self.records = []
      return
    self.records = read_metrics(self.path, start_step) if start_step else []
    write_jsonl(self.path, self.records)
    self._file = open(self.path, 'a')  # noqa: SIM115 (closed by close()).
    if tensorboard:
      # Imported here: only runs that write events pay for the import.
      import tensorboardX

      self._writer = tensorboardX.SummaryWriter(
        logdir=str(out_dir), purge_step=start_step or None, flush_secs=10
      )

  def write(self, record: dict[str, Any]) -> None:
    """Logs one step's record (flushed, so a kill loses at most one line)."""
    self.records.append(record)
    if self._file is None:
      return
    self._file.write(dumps(record) + '\n')
    self._file.flush()
    if self._writer is None:
      return
    for key, value in record.items():
      if key in _NOT_SCALARS or not isinstance(value, int | float):
        continue
      if key.startswith(_EVAL_PREFIX):
        tag = f'eval/{key.removeprefix(_EVAL_PREFIX)}'
      else:
        tag = f'train/{key}'
      self._writer.add_scalar(tag, value, record['step'])

  def close(self) -> None:
    """Flushes and closes both logs."""
    if self._file is not None:
      self._file.close()
    if self._writer is not None:
      self._writer.close()
