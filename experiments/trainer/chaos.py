r"""Kills one process of a multi-process training run, many times over.

Each round starts N trainer processes on 127.0.0.1 (1 CPU device each, a
data mesh of N, ZeRO), lets them reach a moment (start-up, mid-step, or
mid-save: a process held inside a checkpoint save before its commit), ends
one of them (kill -9, SIGTERM, an exception, or a hang: SIGSTOP), and
checks:

* every survivor exits with 4 and prints exactly one ``error:`` line, its
  last, and nothing from jax, XLA or Gloo (no traceback, no abort, no log
  line);
* they exit within the stated bound (a hang: the heartbeat timeout);
* no process of the run is left (each round is its own session);
* the newest committed checkpoint is resumed (none set aside as damaged),
  and the resumed run's losses equal an uninterrupted run's bit for bit.

Usage::

    python -m experiments.trainer.chaos --rounds 100 --seed 0

prints one line per round and then runs and failures by kind.
"""

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from experiments.trainer import checkpointing

_ROOT = pathlib.Path(__file__).resolve().parents[2]
# What a survivor may not print: a traceback, an abort, jax/XLA/Gloo logs.
_FOREIGN = re.compile(
  r'Traceback|(?<!\[)Gloo|gloo::|client\.h|Terminating process|Fatal Python|'
  r'^[IWEF]\d{4} |^\*\*\* |Aborted|XlaRuntimeError|Check failed',
  re.MULTILINE,
)
KINDS = ('kill9', 'term', 'exception', 'hang')
MOMENTS = ('startup', 'step', 'save')
STEPS = 16
EVERY = 4
# Seconds without a heartbeat after which a hung process counts as lost.
HEARTBEAT_S = 8
# Seconds the survivors may take to stop after a death (a loaded machine).
GRACE_S = 30
# Seconds any one launch may take.
LAUNCH_S = 300


def free_port() -> int:
  """A TCP port free on 127.0.0.1 right now."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def child_env(cache: pathlib.Path | None = None) -> dict[str, str]:
  """1 CPU device per process and a compilation cache shared by all."""
  env = dict(os.environ)
  env.update(
    XLA_FLAGS='--xla_force_host_platform_device_count=1',
    JAX_PLATFORMS='cpu',
    PYTHONUNBUFFERED='1',  # Lines land in the logs in the order printed.
  )
  if cache is not None:
    env.update(
      JAX_COMPILATION_CACHE_DIR=str(cache),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
    )
  return env


def train_args(n: int, folder: pathlib.Path) -> list[str]:
  """The flags of every round's run (and of its reference)."""
  return [
    '--config=tiny',
    f'--config.steps={STEPS}',
    '--config.batch_size=6',  # Divisible by 2 and 3 processes.
    f'--config.mesh_data={n}',
    '--config.mesh_seq=1',
    '--config.zero',
    f'--config.checkpoint_every={EVERY}',
    f'--config.checkpoint_dir={folder / "ckpt"}',
    f'--config.out_dir={folder / "run"}',
    '--config.peak_tflops=1',
    '--noconfig.progress',
    f'--config.heartbeat_timeout_s={HEARTBEAT_S}',
    # A death before all joined waits this long.
    '--config.init_timeout_s=60',
  ]


class Job:
  """N trainer processes, each in its own session, each with its log."""

  def __init__(
    self,
    n: int,
    args: list[str],
    folder: pathlib.Path,
    name: str,
    env: dict[str, str],
    extra_env: dict[int, dict[str, str]] | None = None,
  ):
    """Starts processes 0..n-1 of one run; `extra_env[i]` goes to i."""
    port = free_port()
    self.logs = [folder / f'{name}-{i}.log' for i in range(n)]
    self.procs = []
    for i, log in enumerate(self.logs):
      launch = [
        f'--config.coordinator=127.0.0.1:{port}',
        f'--config.num_processes={n}',
        f'--config.process_id={i}',
      ]
      with open(log, 'w') as out:
        self.procs.append(
          subprocess.Popen(
            [sys.executable, '-m', 'experiments.trainer', *args, *launch],
            cwd=_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, **(extra_env or {}).get(i, {})},
            start_new_session=True,
          )
        )

  def wait(self, timeout_s: float) -> list[int | None]:
    """Exit statuses; None for a process still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    for p in self.procs:
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(max(0.01, deadline - time.monotonic()))
    return [p.poll() for p in self.procs]

  def out(self, i: int) -> str:
    """What process `i` printed (stdout and stderr)."""
    return self.logs[i].read_text(errors='replace')

  def left_behind(self) -> list[int]:
    """PIDs of processes still in the sessions of this job's processes."""
    sessions = {p.pid for p in self.procs}
    found = []
    for entry in pathlib.Path('/proc').iterdir():
      if not entry.name.isdigit():
        continue
      try:
        stat = (entry / 'stat').read_text()
      except OSError:
        continue
      fields = stat.rsplit(')', 1)[1].split()
      if fields[0] != 'Z' and int(fields[3]) in sessions:
        found.append(int(entry.name))
    return found

  def kill_all(self) -> None:
    """Kills every process of every session of the job (cleanup)."""
    for p in self.procs:
      with contextlib.suppress(OSError):
        os.killpg(p.pid, signal.SIGKILL)
    for p in self.procs:
      p.wait()


def metrics(folder: pathlib.Path) -> list[dict]:
  """The run folder's metrics lines (complete lines only)."""
  path = folder / 'run' / 'metrics.jsonl'
  if not path.exists():
    return []
  return [json.loads(x) for x in path.read_text().split('\n')[:-1]]


def committed_steps(folder: pathlib.Path) -> list[int]:
  """Steps whose checkpoint Orbax committed (renamed into place)."""
  ckpt = folder / 'ckpt'
  if not ckpt.exists():
    return []
  return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


def reference(n: int, folder: pathlib.Path, env: dict[str, str]) -> list:
  """The losses of an uninterrupted run of `n` processes."""
  folder.mkdir(parents=True, exist_ok=True)
  job = Job(n, train_args(n, folder), folder, 'reference', env)
  codes = job.wait(LAUNCH_S)
  job.kill_all()
  if codes != [0] * n:
    raise RuntimeError(f'reference run failed {codes}:\n{job.out(0)[-3000:]}')
  return [r['loss'] for r in metrics(folder)]


@dataclasses.dataclass(frozen=True)
class Round:
  """One round: N processes, which one ends, when and how."""

  n: int
  victim: int
  moment: str
  kind: str
  # Start-up: seconds after every process joined jax.distributed (then the
  # watchdog connects, the run is planned, built and compiled); mid-step:
  # the number of steps logged first; mid-save: the step whose save holds.
  at: float

  @classmethod
  def draw(cls, rng: random.Random, ns: Sequence[int] = (2, 3)) -> 'Round':
    """A random round."""
    n = rng.choice(ns)
    moment = rng.choice(MOMENTS)
    at = {
      'startup': rng.uniform(0.0, 6.0),
      'step': rng.randrange(1, STEPS - 4),
      'save': EVERY * rng.randrange(1, STEPS // EVERY),
    }[moment]
    return cls(n, rng.randrange(n), moment, rng.choice(KINDS), at)

  @classmethod
  def parse(cls, text: str) -> 'Round':
    """A round from ``N,VICTIM,MOMENT,KIND,AT``."""
    n, victim, moment, kind, at = text.split(',')
    assert moment in MOMENTS and kind in KINDS, text
    return cls(int(n), int(victim), moment, kind, float(at))


_SIGNAL = {
  'kill9': signal.SIGKILL,
  'term': signal.SIGTERM,
  'exception': signal.SIGUSR1,
  'hang': signal.SIGSTOP,
}


def _reach(job: Job, r: Round, folder: pathlib.Path) -> str | None:
  """Waits for the round's moment; a problem's description, or None."""
  deadline = time.monotonic() + LAUNCH_S
  joined = None  # When every process had joined jax.distributed.
  while time.monotonic() < deadline:
    if any(p.poll() is not None for p in job.procs):
      return 'a process ended before the kill'
    if (
      r.moment == 'startup'
      and joined is None
      and all(f'process {i} of ' in job.out(i) for i in range(r.n))
    ):
      joined = time.monotonic()
    if r.moment == 'startup' and joined and time.monotonic() - joined >= r.at:
      return None
    if r.moment == 'step' and len(metrics(folder)) >= r.at:
      return None
    if r.moment == 'save' and 'holding the save' in job.out(r.victim):
      return None
    time.sleep(0.005)
  return 'the moment never came'


def _check_survivors(job: Job, r: Round, codes: list) -> list[str]:
  """Failures of the survivors: exit status, output, what is left."""
  failures = []
  for i, code in enumerate(codes):
    if i == r.victim:
      continue
    out = job.out(i)
    lines = out.splitlines()
    errors = [x for x in lines if x.startswith('error:')]
    if code is None:
      failures.append(f'survivor_hung: process {i} still running')
    elif code != 4:
      failures.append(f'survivor_exit: process {i} exited {code}')
    if code is not None and not (
      len(errors) == 1 and lines and lines[-1] == errors[0]
    ):
      failures.append(f'survivor_lines: process {i}: {errors or lines[-3:]}')
    if m := _FOREIGN.search(out):
      failures.append(f'survivor_noise: process {i}: {m.group(0)!r}')
  return failures


def run_round(
  r: Round,
  folder: pathlib.Path,
  env: dict[str, str],
  want: list[float],
) -> tuple[list[str], float]:
  """Runs one round in `folder`.

  Returns:
    Its failures (empty when clean), and the seconds from the kill until
    every survivor had exited.
  """
  extra = {r.victim: {'EXPERIMENTS_TEST_RAISE_ON_SIGUSR1': '1'}}
  if r.moment == 'save':
    extra[r.victim][checkpointing.HOLD_SAVE_ENV] = str(int(r.at))
  job = Job(r.n, train_args(r.n, folder), folder, 'chaos', env, extra)
  try:
    if problem := _reach(job, r, folder):
      return [f'setup: {problem}: {job.out(0)[-2000:]}'], math.nan
    victim = job.procs[r.victim].pid
    if r.kind in ('hang', 'exception'):  # Supervisor and trainer child.
      os.killpg(victim, _SIGNAL[r.kind])
    else:
      os.kill(victim, _SIGNAL[r.kind])
    bound = GRACE_S + (HEARTBEAT_S if r.kind == 'hang' else 0)
    survivors = [p for i, p in enumerate(job.procs) if i != r.victim]
    killed = time.monotonic()
    deadline = killed + bound
    for p in survivors:
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(max(0.01, deadline - time.monotonic()))
    took = time.monotonic() - killed
    if r.kind in ('hang', 'exception') or r.moment == 'save':
      # A stopped, raising or held victim may still be there: end it.
      job.procs[r.victim].kill()
    job.procs[r.victim].wait(GRACE_S)
    codes = [p.poll() for p in job.procs]
    failures = _check_survivors(job, r, codes)
    time.sleep(0.2)  # Let orphans, if any, show up.
    if left := job.left_behind():
      failures.append(f'left_behind: pids {left}')
  finally:
    job.kill_all()
  return failures + _check_resume(r, folder, env, want), took


def _check_resume(
  r: Round, folder: pathlib.Path, env: dict[str, str], want: list[float]
) -> list[str]:
  """Resumes (or restarts, with nothing committed) and compares losses."""
  steps = committed_steps(folder)
  args = train_args(r.n, folder) + (['--config.resume'] if steps else [])
  job = Job(r.n, args, folder, 'resume', env)
  codes = job.wait(LAUNCH_S)
  job.kill_all()
  if codes != [0] * r.n:
    return [f'resume_exit: {codes}: {job.out(0)[-1500:]}']
  out = job.out(0)
  if 'damaged' in out:
    return [f'checkpoint_damaged: {out[-1500:]}']
  if steps and f'at step {steps[-1]}' not in out:
    return [f'checkpoint_not_newest: committed {steps}: {out[-1500:]}']
  got = [m['loss'] for m in metrics(folder)]
  if got != want:
    return [f'resume_mismatch: {len(got)} losses differ from the reference']
  return []


def main(argv: Sequence[str] | None = None) -> int:
  """Runs rounds and prints runs and failures by kind; 1 on any failure."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=10)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--keep', action='store_true', help='Keep the folders.')
  parser.add_argument(
    '--max-seconds',
    type=float,
    default=float('inf'),
    help='Start no round after this many seconds.',
  )
  parser.add_argument(
    '--case',
    action='append',
    default=[],
    help='N,VICTIM,MOMENT,KIND,AT: this round instead of random ones.',
  )
  args = parser.parse_args(argv)
  rng = random.Random(args.seed)
  work = pathlib.Path(tempfile.mkdtemp(prefix='chaos-'))
  env = child_env(work / 'cache')
  start = time.monotonic()
  cases = [Round.parse(c) for c in args.case]
  rounds = cases or [Round.draw(rng) for _ in range(args.rounds)]
  want = {n: reference(n, work / f'ref{n}', env) for n in {r.n for r in rounds}}
  runs: collections.Counter = collections.Counter()
  failed: collections.Counter = collections.Counter()
  for k, r in enumerate(rounds):
    if time.monotonic() - start > args.max_seconds:
      print(f'stopped after {k} rounds: --max-seconds {args.max_seconds:g}')
      break
    folder = work / f'round{k:03d}'
    folder.mkdir()
    t0 = time.monotonic()
    failures, took = run_round(r, folder, env, want[r.n])
    runs[(r.moment, r.kind)] += 1
    for f in failures:
      failed[f.split(':')[0]] += 1
    verdict = 'ok' if not failures else '; '.join(failures)[:400]
    print(
      f'round {k}: {r.n} processes, process {r.victim} {r.kind} at '
      f'{r.moment} ({r.at:g}): {verdict} (survivors out in {took:.1f} s; '
      f'round {time.monotonic() - t0:.0f} s)',
      flush=True,
    )
    if not failures and not args.keep:
      shutil.rmtree(folder)
  total = sum(runs.values())
  bad = sum(failed.values())
  print(f'rounds: {total} in {time.monotonic() - start:.0f} s; by moment/kind:')
  for key, count in sorted(runs.items()):
    print(f'  {key[0]:8s} {key[1]:10s} {count}')
  print(f'failures: {bad}')
  for kind, count in sorted(failed.items()):
    print(f'  {kind}: {count}')
  print(f'folders: {work}')
  return 1 if bad else 0


if __name__ == '__main__':
  sys.exit(main())
