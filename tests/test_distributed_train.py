"""The trainer as 2 `jax.distributed` CPU processes on 127.0.0.1.

Each process gets 2 fake CPU devices; the mesh is data 2 x seq 2 over all 4,
with ZeRO. The reference is the same global mesh in one process (the first
4 of this test process's 8 devices). Its 'data' all-reduce is 2-way, which
adds the same two numbers whether gloo does it across processes or XLA
across local devices, so the losses are compared bit for bit.

Every process is started with a deadline and killed past it, so a hang
fails the test instead of stalling it.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from experiments.trainer import train

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TRAIN = [sys.executable, '-m', 'experiments.trainer']
# How long any one trainer process may take (a loaded 2-core machine).
_TIMEOUT_S = 240
_STEPS = 30


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def env(tmp_path_factory):
  """2 CPU devices per process, and a compilation cache shared by all."""
  cache = tmp_path_factory.mktemp('jax_cache')
  env = dict(os.environ)
  env.update(
    XLA_FLAGS='--xla_force_host_platform_device_count=2',
    JAX_PLATFORMS='cpu',
    JAX_COMPILATION_CACHE_DIR=str(cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
  )
  return env


def _args(run_dir: pathlib.Path, ckpt_dir: pathlib.Path, every: int) -> list:
  return [
    '--preset=tiny',
    f'--steps={_STEPS}',
    '--mesh-data=2',
    '--mesh-seq=2',
    '--zero',
    f'--checkpoint-every={every}',
    f'--checkpoint-dir={ckpt_dir}',
    f'--out-dir={run_dir}',
    '--peak-tflops=1',  # Skips timing a CPU matmul at startup.
    '--no-progress',
  ]


class Job:
  """The 2 processes of one multi-process run, with their logs."""

  def __init__(self, args: list, logs: pathlib.Path, env, name: str):
    port = _free_port()
    self.logs = [logs / f'{name}-{i}.log' for i in range(2)]
    self.procs = []
    for i, log in enumerate(self.logs):
      with open(log, 'w') as out:
        self.procs.append(
          subprocess.Popen(
            [
              *_TRAIN,
              *args,
              f'--coordinator=127.0.0.1:{port}',
              '--num-processes=2',
              f'--process-id={i}',
              '--heartbeat-timeout-s=10',
            ],
            cwd=_ROOT,
            stdout=out,
            stderr=out,
            env=env,
          )
        )

  def wait(self, timeout_s: float = _TIMEOUT_S) -> list[int]:
    """Exit statuses; processes still running past the deadline are killed."""
    deadline = time.monotonic() + timeout_s
    for p in self.procs:
      try:
        p.wait(max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    return [p.returncode for p in self.procs]

  def out(self, i: int) -> str:
    return self.logs[i].read_text()


def _metrics(run_dir: pathlib.Path) -> list[dict]:
  path = run_dir / 'metrics.jsonl'
  if not path.exists():
    return []
  return [json.loads(x) for x in path.read_text().split('\n')[:-1]]


def _losses(run_dir: pathlib.Path) -> list[float]:
  return [r['loss'] for r in _metrics(run_dir)]


@pytest.fixture(scope='module')
def reference(tmp_path_factory) -> list[dict]:
  """The same run in this process: one process, the same 2 x 2 mesh."""
  tmp = tmp_path_factory.mktemp('ref')
  assert train.main(_args(tmp / 'run', tmp / 'ckpt', 0)) == 0
  records = _metrics(tmp / 'run')
  assert [r['step'] for r in records] == list(range(_STEPS))
  return records


def test_two_processes_train_as_one(tmp_path, env, reference):
  run_dir = tmp_path / 'run'
  job = Job(_args(run_dir, tmp_path / 'ckpt', 10), tmp_path, env, 'job')
  assert job.wait() == [0, 0], job.out(0)[-3000:] + job.out(1)[-3000:]
  for i in range(2):
    first = job.out(i).splitlines()[0]
    assert first.startswith(f'process {i} of 2 '), first
    assert '2 of 4 devices here' in first
  # Only process 0 wrote the run folder: one line per step, one event file.
  got = _metrics(run_dir)
  assert [r['step'] for r in got] == list(range(_STEPS))
  assert len(list(run_dir.glob('events.out.tfevents.*'))) == 1
  assert json.loads((run_dir / 'summary.json').read_text())['steps'] == _STEPS
  for key in ('loss', 'grad_norm', 'param_norm'):
    assert [r[key] for r in got] == [r[key] for r in reference], key
  saved = sorted(
    int(p.name) for p in (tmp_path / 'ckpt').iterdir() if p.name.isdigit()
  )
  assert saved == [10, 20, 30]


def test_lost_process_caught_then_both_resume(tmp_path, env, reference):
  run_dir, ckpt_dir = tmp_path / 'run', tmp_path / 'ckpt'
  args = _args(run_dir, ckpt_dir, 5)
  job = Job(args, tmp_path, env, 'victim')
  deadline = time.monotonic() + _TIMEOUT_S
  while time.monotonic() < deadline and len(_metrics(run_dir)) < 3:
    assert all(p.poll() is None for p in job.procs), job.out(0)
    time.sleep(0.01)

  # A second job on the same checkpoint folder is refused, every process.
  other = Job(_args(tmp_path / 'other', ckpt_dir, 5), tmp_path, env, 'other')
  assert other.wait() == [2, 2], other.out(0)[-2000:]
  for i in range(2):
    err = [x for x in other.out(i).splitlines() if x.startswith('error:')]
    assert len(err) == 1 and 'in use by another trainer' in err[0], err

  while time.monotonic() < deadline and len(_metrics(run_dir)) < 12:
    assert all(p.poll() is None for p in job.procs), job.out(0)
    time.sleep(0.005)
  if len(_metrics(run_dir)) >= _STEPS - 1:
    pytest.fail('the run finished before it could be killed')
  job.procs[1].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  assert job.wait(60) == [4, -signal.SIGKILL], job.out(0)[-3000:]
  assert time.monotonic() - killed < 60
  lost = [x for x in job.out(0).splitlines() if 'lost process' in x]
  assert lost == [x for x in lost if x.startswith('error: lost process 1 ')]
  assert len(lost) == 1, job.out(0)[-3000:]

  # Another topology first, from a copy: 1 process x 4 devices.
  shutil.copytree(ckpt_dir, tmp_path / 'ckpt1')
  (tmp_path / 'ckpt1' / '.lock').unlink(missing_ok=True)
  one = [*_args(tmp_path / 'one', tmp_path / 'ckpt1', 5), '--resume']
  assert train.main(one) == 0
  restarted = Job([*args, '--resume'], tmp_path, env, 'restart')
  assert restarted.wait() == [0, 0], restarted.out(0)[-3000:]
  assert 'resumed from' in restarted.out(0)

  got = _metrics(run_dir)
  assert [r['step'] for r in got] == list(range(_STEPS))
  resumed = [r['step'] for r in got if r.get('resumed')]
  assert len(resumed) == 1 and resumed[0] % 5 == 0 and resumed[0] >= 10
  assert [r['loss'] for r in got] == [r['loss'] for r in reference]
  tail = _metrics(tmp_path / 'one')
  assert tail and tail[0]['step'] == resumed[0]
  assert [r['loss'] for r in tail] == [
    r['loss'] for r in reference[resumed[0] :]
  ]


def test_incomplete_launch_flags_are_one_line(capsys):
  assert train.main(['--preset=tiny', '--coordinator=127.0.0.1:1']) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and '--num-processes' in err, err


def test_auto_without_a_cluster_is_refused(env):
  bare = {k: v for k, v in env.items() if not k.startswith(('SLURM', 'OMPI'))}
  proc = subprocess.run(
    [*_TRAIN, '--preset=tiny', '--distributed=auto'],
    cwd=_ROOT,
    capture_output=True,
    text=True,
    timeout=_TIMEOUT_S,
    env=bare,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.startswith('error: jax.distributed: ')
  assert proc.stderr.count('\n') == 1, proc.stderr
