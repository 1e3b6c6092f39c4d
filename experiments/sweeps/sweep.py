"""Runs a grid of training runs, each in its own time-limited subprocess.

The grid (model size x optimizer/executor x sequence length x weights policy)
comes from a small TOML or JSON file under ``experiments/sweeps/``::

    python -m experiments.sweeps.sweep experiments/sweeps/cpu_optimizers.toml
    python -m experiments.sweeps.sweep CONFIG --dry-run     # list the runs only

Every grid point becomes one ``python -m experiments.trainer ... --out-dir
runs/sweep/<run-id> --no-progress --steps K`` subprocess. One JSON line per
run is appended to the results file as soon as the run ends: the grid point,
``status`` (``ok``, ``failed`` or ``timeout``), ``error`` (the tail of stderr
for failures) and ``summary``. A run id is a slug of the grid point plus a
hash of its full command line, so re-running the sweep skips the runs that
already finished ``ok``; failed and timed-out runs are tried again (their old
lines stay in the file) unless ``--no-retry``.

The summary is the trainer's own ``summary.json`` (which it writes once all
steps are done, resident bytes per parameter by memory kind included); a run
that exits 0 without one is recorded ``failed``. Step-time statistics come
from its ``metrics.jsonl``.

Config file format (TOML; JSON with the same structure also works)::

    description = 'what the sweep asks'
    results = 'results/sweep/NAME.jsonl'   # the JSONL file
    runs_dir = 'runs/sweep'                # parent of the run folders
    steps = 12
    repeats = 1                            # passes over the whole grid
    timeout_s = 300                        # per run
    flags = {batch_size = 1, warmup_steps = 2}   # passed to every run

    [grid]
    seq_len = [32, 128]
    weights_policy = ['stationary']
    # optimizer = ['optax', 'device']      # names, or these tables:

    [[grid.optimizer]]
    name = 'so-xla'
    optimizer = 'superoffload'             # default: the name
    executor = 'xla_host'
    flags = ['--clip-norm=1.0']

    [[grid.model]]
    name = '5m'
    preset = 'small'                       # the default
    flags = {d_model = 256, num_layers = 6, num_heads = 4, mlp_dim = 1024}

A grid axis ``processes = [1, 2]`` runs each point as that many
`jax.distributed` processes on this host (127.0.0.1, a free port, one
``--process-id`` each; the mesh flags must span all their devices, as the
environment's ``XLA_FLAGS`` or GPUs give them); the run is ``ok`` when
every process exits 0, and a timeout kills them all.

(TOML allows either the ``optimizer = [...]`` array or ``[[grid.optimizer]]``
tables, not both; an array may mix names and one-line tables.) Flags are
``{field = value}`` tables (``d_model = 256`` becomes ``--d-model=256``,
``true``/``false`` become ``--flag``/``--no-flag``) or lists of command-line
strings. Any grid entry (model or optimizer) may carry extra ``flags``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import pathlib
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

# The keys of the trainer's `summary.json` (null when a run cannot give one).
SUMMARY_KEYS = (
  'preset',
  'optimizer',
  'executor',
  'num_params',
  'steps',
  'first_loss',
  'final_loss',
  'eval_loss',
  'eval_bpb',
  'tokens_per_s',
  'step_time_s_median',
  'mfu',
  'host_bytes_per_param',
  'device_bytes_per_param',
  'wall_time_s',
  'out_dir',
)

# The default trainer command; the run's flags follow it.
TRAINER = (sys.executable, '-m', 'experiments.trainer')

# Characters of stderr kept as the error text of a failed run.
ERROR_TAIL_CHARS = 3000


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One grid point, resolved to a trainer command line."""

  run_id: str
  grid: dict[str, Any]
  flags: tuple[str, ...]
  # jax.distributed processes of the run (1: a plain single process).
  processes: int = 1

  def argv(self, trainer: Sequence[str], out_dir: pathlib.Path) -> list[str]:
    """The full command line of this run (of each of its processes)."""
    return [*trainer, *self.flags, f'--out-dir={out_dir}', '--no-progress']


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """A parsed sweep config file."""

  name: str
  description: str
  results: pathlib.Path
  runs_dir: pathlib.Path
  steps: int
  timeout_s: float
  runs: tuple[RunSpec, ...]
  trainer: tuple[str, ...] = TRAINER


@dataclasses.dataclass(frozen=True)
class ProcessResult:
  """What a runner reports about one finished (or killed) subprocess."""

  returncode: int | None
  stdout: str
  stderr: str
  timed_out: bool
  wall_s: float


Runner = Callable[[Sequence[str], float, pathlib.Path], ProcessResult]
MultiRunner = Callable[
  [Sequence[Sequence[str]], float, pathlib.Path], ProcessResult
]


def flag_args(flags: Any) -> list[str]:
  """Turns a ``{field: value}`` table (or a list of strings) into CLI flags.

  Args:
    flags: None, a list of command-line strings, or a mapping from `Config`
      field names (``d_model`` or ``d-model``) to values.

  Returns:
    The flags as command-line strings, e.g. ``['--d-model=256']``.

  Raises:
    TypeError: If `flags` is neither a mapping nor a list.
  """
  if flags is None:
    return []
  if isinstance(flags, list | tuple):
    return [str(f) for f in flags]
  if not isinstance(flags, dict):
    raise TypeError(f'flags must be a table or a list, got {flags!r}')
  out = []
  for key, value in flags.items():
    name = key.replace('_', '-')
    if value is True:
      out.append(f'--{name}')
    elif value is False:
      out.append(f'--no-{name}')
    elif value is None:
      out.append(f'--{name}=none')
    else:
      out.append(f'--{name}={value}')
  return out


def _entry(value: Any, key: str) -> dict[str, Any]:
  """Normalises a grid entry: a scalar becomes ``{name: v, key: v}``."""
  if isinstance(value, dict):
    entry = dict(value)
    entry.setdefault('name', str(entry.get(key, '')))
    if not entry['name']:
      raise ValueError(f'grid entry {value!r} needs a name or a {key!r}')
    return entry
  return {'name': str(value), key: value}


def _slug(text: str) -> str:
  return re.sub(r'[^A-Za-z0-9.]+', '-', text).strip('-').lower()


def make_run_id(grid: dict[str, Any], flags: Sequence[str]) -> str:
  """A readable, stable id: a slug of the grid point and a hash of its flags.

  Args:
    grid: The grid point (model, optimizer, seq_len, weights_policy names).
    flags: The run's full trainer flags (without the output folder).

  Returns:
    E.g. ``'5m-superoffload-s32-stationary-1a2b3c4d'``.
  """
  parts = [grid['model'], grid['optimizer_name']]
  if grid.get('seq_len') is not None:
    parts.append(f's{grid["seq_len"]}')
  if grid.get('weights_policy') is not None:
    parts.append(grid['weights_policy'])
  key = list(flags)
  if grid.get('processes') is not None:
    parts.append(f'p{grid["processes"]}')
    key.append(f'processes={grid["processes"]}')
  if grid.get('repeat') is not None:
    parts.append(f'r{grid["repeat"]}')
    key.append(f'repeat={grid["repeat"]}')
  slug = _slug('-'.join(str(p) for p in parts))
  digest = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:8]
  return f'{slug}-{digest}'


def expand_grid(raw: dict[str, Any]) -> list[RunSpec]:
  """Expands a config's grid into runs, optimizers varying fastest.

  Runs that differ only in the optimizer are adjacent, so the optimizers of
  one model size are measured back to back on a machine whose load drifts.
  With ``repeats = N`` (N > 1) the whole grid runs N times over, each grid
  point once per pass, as points with a ``repeat`` index and their own ids.

  Args:
    raw: The parsed config file (see the module docstring).

  Returns:
    One `RunSpec` per grid point.

  Raises:
    ValueError: If the grid has no models or optimizers, or two grid points
      get the same run id.
  """
  grid = raw.get('grid', {})
  models = [_entry(m, 'preset') for m in grid.get('model', [])]
  optimizers = [_entry(o, 'optimizer') for o in grid.get('optimizer', [])]
  if not models or not optimizers:
    raise ValueError('the grid needs at least one model and one optimizer')
  seq_lens = list(grid.get('seq_len', [None]))
  policies = list(grid.get('weights_policy', [None]))
  process_counts = list(grid.get('processes', [None]))
  steps = int(raw.get('steps', 12))
  common = flag_args(raw.get('flags'))
  runs: list[RunSpec] = []
  for model in models:
    for seq_len in seq_lens:
      for policy in policies:
        for opt in optimizers:
          flags = [f'--preset={model.get("preset", "small")}']
          flags += common
          flags += flag_args(model.get('flags'))
          flags.append(f'--optimizer={opt.get("optimizer", opt["name"])}')
          if opt.get('executor') is not None:
            flags.append(f'--executor={opt["executor"]}')
          flags += flag_args(opt.get('flags'))
          if seq_len is not None:
            flags.append(f'--seq-len={seq_len}')
          if policy is not None:
            flags.append(f'--weights-policy={policy}')
          flags.append(f'--steps={steps}')
          point = {
            'model': model['name'],
            'preset': model.get('preset', 'small'),
            'optimizer_name': opt['name'],
            'optimizer': opt.get('optimizer', opt['name']),
            'executor': opt.get('executor'),
            'seq_len': seq_len,
            'weights_policy': policy,
            'steps': steps,
          }
          for count in process_counts:
            at = point if count is None else {**point, 'processes': count}
            runs.append(
              RunSpec(make_run_id(at, flags), at, tuple(flags), count or 1)
            )
  repeats = int(raw.get('repeats', 1))
  if repeats > 1:
    runs = [
      RunSpec(make_run_id(point, r.flags), point, r.flags, r.processes)
      for rep in range(repeats)
      for r in runs
      for point in [{**r.grid, 'repeat': rep}]
    ]
  ids = [r.run_id for r in runs]
  if len(set(ids)) != len(ids):
    raise ValueError('two grid points have the same run id; rename entries')
  return runs


def load_config(path: str | os.PathLike[str]) -> SweepConfig:
  """Reads a TOML or JSON sweep config.

  Args:
    path: The config file; ``.json`` is read as JSON, anything else as TOML.

  Returns:
    The parsed config with its grid expanded.
  """
  path = pathlib.Path(path)
  text = path.read_text()
  raw = json.loads(text) if path.suffix == '.json' else tomllib.loads(text)
  name = raw.get('name', path.stem)
  trainer = tuple(raw['trainer']) if 'trainer' in raw else TRAINER
  return SweepConfig(
    name=name,
    description=raw.get('description', ''),
    results=pathlib.Path(raw.get('results', f'results/sweep/{name}.jsonl')),
    runs_dir=pathlib.Path(raw.get('runs_dir', 'runs/sweep')),
    steps=int(raw.get('steps', 12)),
    timeout_s=float(raw.get('timeout_s', 600)),
    runs=tuple(expand_grid(raw)),
    trainer=trainer,
  )


def run_subprocess(
  argv: Sequence[str], timeout_s: float, cwd: pathlib.Path
) -> ProcessResult:
  """Runs `argv` in its own process group; kills the group on timeout.

  Args:
    argv: The command line.
    timeout_s: Wall-clock limit in seconds.
    cwd: Working directory of the child.

  Returns:
    The exit status (None when killed), captured output and wall time.
  """
  return run_processes([argv], timeout_s, cwd)


def run_processes(
  argvs: Sequence[Sequence[str]], timeout_s: float, cwd: pathlib.Path
) -> ProcessResult:
  """Runs the processes of one multi-process run; kills all on timeout.

  Returns:
    The first non-zero exit status (0 when all exit 0; None on timeout),
    the output of that process (process 0's when all succeed), and the
    wall time until the last one ended.
  """
  env = dict(os.environ, PYTHONUNBUFFERED='1')
  start = time.perf_counter()
  procs = [
    subprocess.Popen(
      list(argv),
      cwd=cwd,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      start_new_session=True,
    )
    for argv in argvs
  ]
  outputs, timed_out = [], False
  for proc in procs:
    left = max(0.1, timeout_s - (time.perf_counter() - start))
    try:
      outputs.append(proc.communicate(timeout=None if timed_out else left))
    except subprocess.TimeoutExpired:
      timed_out = True
      for other in procs:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(other.pid, signal.SIGKILL)
      outputs.append(proc.communicate())
  codes = [p.returncode for p in procs]
  bad = next((i for i, c in enumerate(codes) if c != 0), 0)
  stdout, stderr = outputs[bad]
  return ProcessResult(
    returncode=None if timed_out else codes[bad],
    stdout=stdout or '',
    stderr=stderr or '',
    timed_out=timed_out,
    wall_s=time.perf_counter() - start,
  )


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  """The records of a JSONL file; a missing file or bad lines are skipped."""
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    line = line.strip()
    if not line:
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue  # A line cut short by a killed sweep.
  return records


def finished_ids(records: Iterable[dict[str, Any]], retry: bool) -> set[str]:
  """Run ids to skip: those recorded ``ok`` (and, without retry, any)."""
  return {
    r['run_id']
    for r in records
    if 'run_id' in r and (r.get('status') == 'ok' or not retry)
  }


def read_summary(out_dir: pathlib.Path) -> dict[str, Any] | None:
  """The run's ``summary.json`` with every `SUMMARY_KEYS` key, or None."""
  path = out_dir / 'summary.json'
  try:
    given = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError):
    return None
  if not isinstance(given, dict):
    return None
  return {**dict.fromkeys(SUMMARY_KEYS), **given}


def step_time_stats(out_dir: pathlib.Path) -> dict[str, Any]:
  """Step times from ``metrics.jsonl``, step 0 (compilation) left out."""
  rows = read_jsonl(out_dir / 'metrics.jsonl')
  times = [r['step_time_s'] for r in rows if r.get('step', 0) > 0]
  times = [t for t in times if isinstance(t, int | float)]
  if not times:
    return {'timed_steps': 0}
  return {
    'timed_steps': len(times),
    'step_time_s_median': statistics.median(times),
    'step_time_s_min': min(times),
    'step_time_s_max': max(times),
    'first_step_s': rows[0].get('step_time_s'),
  }


def source_state(root: pathlib.Path) -> dict[str, Any]:
  """The checked-out commit and what differs from it (read-only git).

  Runs read-only git commands (no optional index locks); empty when `root`
  is not a git checkout.
  """
  env = dict(os.environ, GIT_OPTIONAL_LOCKS='0')

  def git(*args: str) -> str:
    out = subprocess.run(
      ['git', *args], cwd=root, env=env, capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else ''

  commit = git('rev-parse', 'HEAD')
  if not commit:
    return {}
  changed = [
    line[3:] for line in git('status', '--porcelain').splitlines() if line
  ]
  diff = git('diff', 'HEAD')
  return {
    'commit': commit,
    'changed_files': changed,
    # Equal between two runs iff their tracked files had the same content.
    'diff_sha1': hashlib.sha1(diff.encode()).hexdigest(),
  }


def machine() -> dict[str, Any]:
  """Where the sweep runs: platform, CPU count, Python."""
  return {
    'platform': platform.platform(),
    'processor': platform.machine(),
    'cpus': os.cpu_count(),
    'python': platform.python_version(),
  }


def _tail(text: str, chars: int = ERROR_TAIL_CHARS) -> str:
  return text[-chars:].strip()


class Sweep:
  """Runs the grid of a `SweepConfig` and appends one JSON line per run.

  Attributes:
    config: The sweep.
    root: Working directory of the runs (the repository root).
    runner: Runs one command line; `run_subprocess` unless a test fakes it.
    multi_runner: Runs the processes of a multi-process run together.
    log: Receives one progress line per run.
  """

  def __init__(
    self,
    config: SweepConfig,
    root: str | os.PathLike[str] = '.',
    runner: Runner = run_subprocess,
    log: Callable[[str], None] = print,
    multi_runner: MultiRunner = run_processes,
  ):
    self.config = config
    self.root = pathlib.Path(root)
    self.runner = runner
    self.multi_runner = multi_runner
    self.log = log

  @property
  def results_path(self) -> pathlib.Path:
    """The JSONL file, relative paths taken from `root`."""
    return self.root / self.config.results

  def out_dir(self, spec: RunSpec) -> pathlib.Path:
    """The output folder of a run, as passed to the trainer."""
    return self.config.runs_dir / spec.run_id

  def pending(self, retry: bool = True) -> list[RunSpec]:
    """The runs not yet finished according to the results file."""
    done = finished_ids(read_jsonl(self.results_path), retry)
    return [r for r in self.config.runs if r.run_id not in done]

  def run(
    self, retry: bool = True, only: str | None = None
  ) -> list[dict[str, Any]]:
    """Runs every pending grid point in order and records each.

    Args:
      retry: Run failed and timed-out runs again (ok runs are always
        skipped).
      only: If set, run only the run ids containing this substring.

    Returns:
      The records written by this call.
    """
    todo = [r for r in self.pending(retry) if not only or only in r.run_id]
    skipped = len(self.config.runs) - len(self.pending(retry))
    self.log(
      f'sweep {self.config.name}: {len(self.config.runs)} runs, '
      f'{skipped} finished, {len(todo)} to run -> {self.results_path}'
    )
    records = []
    for i, spec in enumerate(todo):
      record = self.run_one(spec)
      records.append(record)
      median = (record.get('summary') or {}).get('step_time_s_median')
      median_text = f'{1e3 * median:.0f} ms/step' if median else '-'
      self.log(
        f'[{i + 1}/{len(todo)}] {spec.run_id}: {record["status"]} '
        f'{median_text} ({record["subprocess_wall_s"]:.0f}s)'
      )
    return records

  def run_one(self, spec: RunSpec) -> dict[str, Any]:
    """Runs one grid point and appends its record to the results file."""
    out_dir = self.out_dir(spec)
    abs_out = self.root / out_dir
    if abs_out.exists():
      shutil.rmtree(abs_out)  # Stale files of an earlier, failed attempt.
    argv = spec.argv(self.config.trainer, out_dir)
    source = source_state(self.root)  # The code this run is about to use.
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')
    if spec.processes > 1:
      port = _free_port()
      argvs = [
        [
          *argv,
          f'--coordinator=127.0.0.1:{port}',
          f'--num-processes={spec.processes}',
          f'--process-id={i}',
        ]
        for i in range(spec.processes)
      ]
      result = self.multi_runner(argvs, self.config.timeout_s, self.root)
    else:
      result = self.runner(argv, self.config.timeout_s, self.root)
    record: dict[str, Any] = {
      'run_id': spec.run_id,
      'sweep': self.config.name,
      'description': self.config.description,
      'grid': spec.grid,
      'argv': [*spec.flags, f'--out-dir={out_dir}', '--no-progress'],
      'started_at': started,
      'subprocess_wall_s': result.wall_s,
      'returncode': result.returncode,
      'out_dir': str(out_dir),
      'source': source,
      'machine': machine(),
    }
    summary = read_summary(abs_out)
    if result.timed_out:
      status = 'timeout'
      error = f'timed out after {self.config.timeout_s:g} s'
      if result.stderr.strip():
        error += '\n' + _tail(result.stderr)
    elif result.returncode != 0:
      status = 'failed'
      error = _tail(result.stderr) or _tail(result.stdout)
      error = error or f'exit status {result.returncode}'
    elif summary is None:
      status = 'failed'
      error = 'the trainer exited 0 but wrote no summary.json'
    else:
      status, error = 'ok', None
    record.update(
      status=status,
      error=error,
      summary=summary,
      summary_source='summary.json' if summary is not None else None,
      step_times=step_time_stats(abs_out),
    )
    self.results_path.parent.mkdir(parents=True, exist_ok=True)
    with open(self.results_path, 'a') as f:
      f.write(json.dumps(record, default=_json_default) + '\n')
    return record


def _json_default(value: Any) -> Any:
  if isinstance(value, float) and math.isnan(value):
    return None
  if isinstance(value, pathlib.Path):
    return str(value)
  raise TypeError(f'not JSON serializable: {value!r}')


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point."""
  parser = argparse.ArgumentParser(
    prog='python -m experiments.sweeps.sweep',
    description=__doc__.split('\n')[0],
  )
  parser.add_argument('config', nargs='?', help='TOML or JSON sweep config')
  parser.add_argument(
    '--dry-run', action='store_true', help='list the runs and their status'
  )
  parser.add_argument(
    '--no-retry',
    action='store_true',
    help='also skip runs recorded as failed or timed out',
  )
  parser.add_argument('--only', help='run only run ids containing this')
  parser.add_argument('--results', help='override the JSONL results file')
  parser.add_argument('--timeout-s', type=float, help='override timeout_s')
  args = parser.parse_args(argv)
  if not args.config:
    parser.error('a sweep config is required')
  config = load_config(args.config)
  if args.results:
    config = dataclasses.replace(config, results=pathlib.Path(args.results))
  if args.timeout_s:
    config = dataclasses.replace(config, timeout_s=args.timeout_s)
  sweep = Sweep(config)
  if args.dry_run:
    pending = {r.run_id for r in sweep.pending(retry=not args.no_retry)}
    for spec in config.runs:
      mark = 'todo' if spec.run_id in pending else 'done'
      print(f'{mark}  {spec.run_id}  {" ".join(spec.flags)}')
    return 0
  records = sweep.run(retry=not args.no_retry, only=args.only)
  return 0 if all(r['status'] == 'ok' for r in records) else 1


if __name__ == '__main__':
  sys.exit(main())
