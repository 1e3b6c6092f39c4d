"""The trainer as 2 `jax.distributed` CPU processes on 127.0.0.1.

Each process gets 2 fake CPU devices; the mesh is data 2 x seq 2 over all 4,
with ZeRO. The reference is the same global mesh in one process (the first
4 of this test process's 8 devices). Its 'data' all-reduce is 2-way, which
adds the same two numbers whether gloo does it across processes or XLA
across local devices, so the losses are compared bit for bit.

The reference saves every 10 steps; its checkpoints (one process x 4
devices) are resumed on 2 processes and onto other ZeRO splits.

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
from typing import NamedTuple

import pytest

from experiments.trainer import checkpointing
from experiments.trainer import config as config_lib
from experiments.trainer import folder_lock
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


def _args(
  run_dir: pathlib.Path, ckpt_dir: pathlib.Path, every: int, old: bool = False
) -> list:
  """The run's flags: ``--config.FIELD=VALUE``, or the older spelling."""
  fields = {
    'steps': _STEPS,
    'mesh_data': 2,
    'mesh_seq': 2,
    'zero': True,
    'checkpoint_every': every,
    'checkpoint_dir': ckpt_dir,
    'out_dir': run_dir,
    'peak_tflops': 1,  # A stated peak: no CPU peak looked up.
    'progress': False,
  }
  out = ['--preset=tiny' if old else '--config=tiny']
  for name, value in fields.items():
    flag = '--' + name.replace('_', '-') if old else f'--config.{name}'
    if isinstance(value, bool):
      no = '--no-' if old else '--no'
      out.append(flag if value else flag.replace('--', no, 1))
    else:
      out.append(f'{flag}={value}')
  return out


def _launch(i: int, port: int, slurm: bool) -> tuple[list[str], dict]:
  """The flags and environment that make a trainer process `i` of 2."""
  if not slurm:
    return [
      f'--config.coordinator=127.0.0.1:{port}',
      '--config.num_processes=2',
      f'--config.process_id={i}',
    ], {}
  return ['--config.distributed=auto'], {
    'SLURM_JOB_ID': '1',
    'SLURM_STEP_NODELIST': 'localhost',
    'SLURM_NTASKS': '2',
    'SLURM_PROCID': str(i),
    'SLURM_LOCALID': str(i),
    # Else the port derives from the job id; a free one is surer.
    'JAX_COORDINATOR_PORT': str(port),
  }


class Job:
  """The 2 processes of one multi-process run, with their logs."""

  def __init__(
    self,
    args: list,
    logs: pathlib.Path,
    env,
    name: str,
    extra_env: dict[int, dict[str, str]] | None = None,
    slurm: bool = False,
  ):
    """Starts both processes; `extra_env[i]` is added to process i's `env`.

    With `slurm`, each process finds its place as under `srun` (2 tasks on
    this host): `--config.distributed=auto` and the variables SLURM sets,
    instead of the explicit flags.
    """
    port = _free_port()
    self.logs = [logs / f'{name}-{i}.log' for i in range(2)]
    self.procs = []
    for i, log in enumerate(self.logs):
      launch, launch_env = _launch(i, port, slurm)
      with open(log, 'w') as out:
        self.procs.append(
          subprocess.Popen(
            [*_TRAIN, *args, *launch, '--config.heartbeat_timeout_s=10'],
            cwd=_ROOT,
            stdout=out,
            stderr=out,
            env={**env, **launch_env, **(extra_env or {}).get(i, {})},
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


def _copy_checkpoints(
  src: pathlib.Path, dst: pathlib.Path, upto: int | None = None
) -> pathlib.Path:
  """`src` copied to `dst` without its lock file, nor steps after `upto`."""

  def left_out(folder: str, names: list[str]) -> list[str]:
    if pathlib.Path(folder) != src:
      return []
    return [
      n
      for n in names
      if n == folder_lock.FolderLock.FILE
      or (upto is not None and n.isdigit() and int(n) > upto)
    ]

  shutil.copytree(src, dst, ignore=left_out)
  return dst


class Reference(NamedTuple):
  """The uninterrupted run: its metrics, and its checkpoints every 10 steps."""

  records: list[dict]
  ckpt: pathlib.Path

  def losses(self, start: int = 0) -> list[float]:
    return [r['loss'] for r in self.records[start:]]


@pytest.fixture(scope='module')
def reference(tmp_path_factory) -> Reference:
  """The same run in this process: one process x 4 devices, the same mesh."""
  tmp = tmp_path_factory.mktemp('ref')
  assert train.main(_args(tmp / 'run', tmp / 'ckpt', 10)) == 0
  records = _metrics(tmp / 'run')
  assert [r['step'] for r in records] == list(range(_STEPS))
  return Reference(records, tmp / 'ckpt')


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
    assert [r[key] for r in got] == [r[key] for r in reference.records], key
  saved = sorted(
    int(p.name) for p in (tmp_path / 'ckpt').iterdir() if p.name.isdigit()
  )
  assert saved == [10, 20, 30]


def test_a_warm_compilation_cache_trains_as_a_cold_one(tmp_path, env):
  # The second run finds the first one's executables in the cache folder
  # (process 0 writes it). On jaxlib 0.12.1 a loaded executable's
  # all-reduce never meets a compiled one's
  # (tests/test_jaxlib_cache_collectives.py): unless the trainer turns the
  # cache off there, the warm run hangs in its first step.
  env = {**env, 'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'cache')}
  losses = []
  for name in ('cold', 'warm'):
    args = _args(tmp_path / name, tmp_path / f'{name}-ckpt', 100)
    args = [a for a in args if not a.startswith('--config.steps=')]
    job = Job([*args, '--config.steps=3'], tmp_path, env, name)
    assert job.wait() == [0, 0], job.out(0)[-3000:] + job.out(1)[-3000:]
    losses.append(_losses(tmp_path / name))
  assert len(losses[0]) == 3 and losses[1] == losses[0], losses


def test_lost_process_caught_then_both_resume(tmp_path, env, reference):
  run_dir, ckpt_dir = tmp_path / 'run', tmp_path / 'ckpt'
  args = _args(run_dir, ckpt_dir, 5)
  # Process 1 parks inside the save of step 25, should the second job below
  # start so slowly (a loaded machine) that the run would end first.
  hold = {1: {checkpointing.HOLD_SAVE_ENV: '25'}}
  job = Job(args, tmp_path, env, 'victim', extra_env=hold)
  deadline = time.monotonic() + _TIMEOUT_S
  while time.monotonic() < deadline and len(_metrics(run_dir)) < 3:
    assert all(p.poll() is None for p in job.procs), job.out(0)
    time.sleep(0.01)

  # A second job on the same checkpoint folder is refused, every process.
  # It is spelled the older way: each rank notes that once (its supervisor
  # does; its trainer child, given the same flags, does not repeat it).
  other_args = _args(tmp_path / 'other', ckpt_dir, 5, old=True)
  other = Job(other_args, tmp_path, env, 'other')
  assert other.wait() == [2, 2], other.out(0)[-2000:]
  for i in range(2):
    lines = other.out(i).splitlines()
    err = [x for x in lines if x.startswith('error:')]
    assert len(err) == 1 and 'in use by another trainer' in err[0], err
    notes = [x for x in lines if x.startswith('note:')]
    assert len(notes) == 1 and '--preset, --steps,' in notes[0], notes

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
  ckpt1 = _copy_checkpoints(ckpt_dir, tmp_path / 'ckpt1')
  one = [*_args(tmp_path / 'one', ckpt1, 5), '--config.resume']
  assert train.main(one) == 0
  restarted = Job([*args, '--config.resume'], tmp_path, env, 'restart')
  assert restarted.wait() == [0, 0], restarted.out(0)[-3000:]
  assert 'resumed from' in restarted.out(0)

  got = _metrics(run_dir)
  assert [r['step'] for r in got] == list(range(_STEPS))
  resumed = [r['step'] for r in got if r.get('resumed')]
  assert len(resumed) == 1 and resumed[0] % 5 == 0 and resumed[0] >= 10
  assert [r['loss'] for r in got] == reference.losses()
  tail = _metrics(tmp_path / 'one')
  assert tail and tail[0]['step'] == resumed[0]
  assert [r['loss'] for r in tail] == reference.losses(resumed[0])


def test_one_process_checkpoint_resumes_on_two(tmp_path, env, reference):
  # Saved by 1 process x 4 devices at step 10, resumed by 2 x 2: the same
  # mesh, so the same reductions, bit for bit. Launched as under SLURM.
  ckpt = _copy_checkpoints(reference.ckpt, tmp_path / 'ckpt', upto=10)
  run_dir = tmp_path / 'run'
  args = [*_args(run_dir, ckpt, 10), '--config.resume']
  job = Job(args, tmp_path, env, 'two', slurm=True)
  assert job.wait() == [0, 0], job.out(0)[-3000:] + job.out(1)[-3000:]
  for i in range(2):
    first = job.out(i).splitlines()[0]
    assert first.startswith(f'process {i} of 2 (coordinator localhost:')
  assert f'resumed from {ckpt} at step 10' in job.out(0)
  got = _metrics(run_dir)
  assert [r['step'] for r in got] == list(range(10, _STEPS))
  for key in ('loss', 'grad_norm', 'param_norm'):
    assert [r[key] for r in got] == [r[key] for r in reference.records[10:]]


# fp32's unit roundoff.
_U = 2.0**-24


@pytest.mark.parametrize(
  'split, processes',
  [
    pytest.param(
      ['--config.mesh_data=4', '--config.mesh_seq=1'], 2, id='zero_2_to_4'
    ),
    pytest.param(['--noconfig.zero'], 1, id='sharded_to_replicated'),
  ],
)
def test_resume_onto_another_zero_split(
  tmp_path, env, reference, split, processes, capsys
):
  """A checkpoint of the state sharded over 'data' (2) resumed differently.

  Over 4 'data' devices of 2 processes, or with the state replicated on
  the same 2 x 2 mesh in one, XLA partitions the step into other
  collectives, so the loss (over 4 devices) and the gradients are summed
  across devices in another order and the losses are not bit-exact. The
  bound: a step's loss is the mean of n = batch x seq_len positive token
  losses, and any two fp32 summation orders of n positive numbers differ
  by at most 2 (n - 1) u relative (each is within (n - 1) u of the exact
  sum). The first resumed step starts from
  the same restored state (checksummed) and batch, so that bounds it. Each
  later step adds at most one more such rounding, through the gradient
  reduction, to the parameters it starts from; the bound grows by as much
  per step, which assumes that these 20 steps of a tiny model do not
  amplify a rounding difference: the test checks that, it does not prove
  it. (They stay within 2 ulps; a wrong schedule is off by 1e-2.)
  """
  tiny = config_lib.get_config('tiny')
  n = tiny.batch_size * tiny.seq_len
  ckpt = _copy_checkpoints(reference.ckpt, tmp_path / 'ckpt', upto=10)
  args = [*_args(tmp_path / 'run', ckpt, 10), '--config.resume', *split]
  if processes == 1:
    assert train.main(args) == 0
    out = capsys.readouterr().out
  else:
    job = Job(args, tmp_path, env, 'split')
    assert job.wait() == [0, 0], job.out(0)[-3000:] + job.out(1)[-3000:]
    out = job.out(0)
  assert 'resuming with changed settings' in out
  got = [r['loss'] for r in _metrics(tmp_path / 'run')]
  want = reference.losses(10)
  assert len(got) == len(want) == _STEPS - 10
  for k, (a, b) in enumerate(zip(got, want, strict=True)):
    assert abs(a - b) <= (k + 1) * 2 * (n - 1) * _U * b, (k, a, b)


def test_kill_mid_save_keeps_the_previous_checkpoint(tmp_path, env, reference):
  run_dir, ckpt_dir = tmp_path / 'run', tmp_path / 'ckpt'
  args = _args(run_dir, ckpt_dir, 5)
  # Process 1 stops inside the save of step 10, its shards written and the
  # step not committed (process 0 commits only once both are past that).
  hold = {1: {checkpointing.HOLD_SAVE_ENV: '10'}}
  job = Job(args, tmp_path, env, 'held', extra_env=hold)
  deadline = time.monotonic() + _TIMEOUT_S
  while 'holding the save of step 10' not in job.out(1):
    assert time.monotonic() < deadline, job.out(1)[-3000:]
    assert all(p.poll() is None for p in job.procs), job.out(1)[-3000:]
    time.sleep(0.02)
  partial = list(ckpt_dir.glob('10.orbax-checkpoint-tmp*'))
  steps = sorted(p.name for p in ckpt_dir.iterdir() if p.name.isdigit())
  assert partial and steps == ['5'], (partial, steps)  # Mid-save.
  job.procs[1].send_signal(signal.SIGKILL)
  assert job.wait(60) == [4, -signal.SIGKILL], job.out(0)[-3000:]
  assert not (ckpt_dir / '10').exists() and all(p.exists() for p in partial)

  restarted = Job([*args, '--config.resume'], tmp_path, env, 'after')
  assert restarted.wait() == [0, 0], restarted.out(0)[-3000:]
  out = restarted.out(0)
  assert f'resumed from {ckpt_dir} at step 5' in out and 'damaged' not in out
  got = _metrics(run_dir)
  assert [r['step'] for r in got] == list(range(_STEPS))
  assert [r['step'] for r in got if r.get('resumed')] == [5]
  assert [r['loss'] for r in got] == reference.losses()
  # The restart cleaned up the partial save.
  assert not any(p.exists() for p in partial)


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


def test_the_single_machine_recipe_runs_as_written(tmp_path):
  """docs/trainer.md's recipe, pasted into bash: 2 processes equal 1."""
  text = (_ROOT / 'docs' / 'trainer.md').read_text()
  block = text.split('# single-machine recipe\n', 1)[1].split('```', 1)[0]
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env.update(
    OUT=str(tmp_path),
    PORT=str(_free_port()),
    PATH=f'{pathlib.Path(sys.executable).parent}:{env["PATH"]}',
  )
  proc = subprocess.run(
    ['bash', '-c', block],
    cwd=_ROOT,
    capture_output=True,
    text=True,
    timeout=3 * _TIMEOUT_S,
    env=env,
  )
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0 and 'same losses' in out, out[-3000:]
  assert 'process 1: done at step 20' in out
  assert out.count('done: loss') == 2  # Process 0 of two, and the one.
