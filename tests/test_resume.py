"""Tests of `python -m experiments.trainer` as a long-running job.

The trainer runs in subprocesses, as a scheduler would run it: killed with
SIGKILL and resumed, stopped with SIGTERM. Subprocesses share a persistent
compilation cache, so only the first one compiles the train step.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from experiments.trainer import checkpointing
from experiments.trainer import train

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TRAIN = [sys.executable, '-m', 'experiments.trainer']
# How long any one trainer process may take (a loaded 2-core machine).
_TIMEOUT_S = 300


@pytest.fixture(scope='module')
def env(tmp_path_factory):
  """The subprocesses' environment: this one's (8 CPU devices) plus a cache."""
  cache = tmp_path_factory.mktemp('jax_cache')
  return {
    **os.environ,
    'JAX_COMPILATION_CACHE_DIR': str(cache),
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
  }


def _metrics(run_dir: pathlib.Path) -> list[dict]:
  """The complete lines of a run's metrics.jsonl (none if missing)."""
  path = run_dir / 'metrics.jsonl'
  if not path.exists():
    return []
  lines = path.read_text().split('\n')[:-1]  # The last one may be torn.
  return [json.loads(line) for line in lines]


def _start(args: list[str], log: pathlib.Path, env) -> subprocess.Popen:
  with open(log, 'w') as out:
    return subprocess.Popen(
      [*_TRAIN, *args], cwd=_ROOT, stdout=out, stderr=out, env=env
    )


def _wait_for_step(
  proc: subprocess.Popen, run_dir: pathlib.Path, step: int
) -> list[dict]:
  """Polls metrics.jsonl until it shows `step`; [] if the process ends."""
  deadline = time.monotonic() + _TIMEOUT_S
  while time.monotonic() < deadline and proc.poll() is None:
    records = _metrics(run_dir)
    if records and records[-1]['step'] >= step:
      return records
    time.sleep(0.005)
  return []


def _finish(proc: subprocess.Popen, log: pathlib.Path) -> str:
  proc.wait(_TIMEOUT_S)
  return log.read_text()


def _tiny(run_dir: pathlib.Path, ckpt_dir: pathlib.Path, steps: int) -> list:
  return [
    '--preset=tiny',
    '--optimizer=superoffload',
    f'--steps={steps}',
    '--checkpoint-every=10',
    f'--checkpoint-dir={ckpt_dir}',
    f'--out-dir={run_dir}',
    '--peak-tflops=1',  # Skips timing a CPU matmul at startup.
  ]


@pytest.fixture(scope='module', params=['fp32', '8bit'])
def killed_run(tmp_path_factory, env, request):
  """The acceptance scenario: a 40-step run killed -9 after step 25, resumed.

  Once with fp32 moments and once with 8-bit ones (`--moments`).

  Returns:
    ``(args, tmp)``: the flags of the killed (and resumed) run and the
    folder holding ``run`` (its run folder), ``ckpt`` (its checkpoints),
    ``ref`` (an uninterrupted run) and the logs.
  """
  tmp = tmp_path_factory.mktemp('kill9')
  run_dir, ckpt_dir = tmp / 'run', tmp / 'ckpt'
  moments = f'--moments={request.param}'
  args = [*_tiny(run_dir, ckpt_dir, 40), moments]
  victim = _start(args, tmp / 'victim.log', env)
  seen = []

  def kill_after_step_25():
    seen.extend(_wait_for_step(victim, run_dir, 25))
    victim.send_signal(signal.SIGKILL)

  killer = threading.Thread(target=kill_after_step_25)
  killer.start()
  # Meanwhile, the uninterrupted run, in this process.
  ref_args = [
    *_tiny(tmp / 'ref', tmp / 'ref_ckpt', 40),
    moments,
    '--no-progress',
  ]
  assert train.main(ref_args) == 0
  killer.join(_TIMEOUT_S)
  victim.wait(_TIMEOUT_S)
  log = (tmp / 'victim.log').read_text()
  assert victim.returncode == -signal.SIGKILL, log
  assert seen, log
  if seen[-1]['step'] >= 39:
    pytest.fail('the run finished before it could be killed')
  (tmp / 'killed_at').write_text(str(_metrics(run_dir)[-1]['step']))
  resumed_log = tmp / 'resumed.log'
  proc = _start([*args, '--resume'], resumed_log, env)
  out = _finish(proc, resumed_log)
  assert proc.returncode == 0, out
  return args, tmp


def test_kill9_and_resume_is_bit_identical(killed_run):
  _, tmp = killed_run
  out = (tmp / 'resumed.log').read_text()
  assert 'resumed from' in out
  assert 'Traceback' not in out
  want, got = _metrics(tmp / 'ref'), _metrics(tmp / 'run')
  assert [r['step'] for r in want] == list(range(40))
  # Every step logged once (the lines past the checkpoint were dropped).
  killed_at = int((tmp / 'killed_at').read_text())
  assert [r['step'] for r in got] == list(range(40)), killed_at
  # Resumed from a periodic checkpoint at or before the kill.
  resumed = [r['step'] for r in got if r.get('resumed')]
  assert len(resumed) == 1, resumed
  assert resumed[0] % 10 == 0 and 10 <= resumed[0] <= killed_at + 1
  # Bit for bit (JSON floats round-trip exactly), and the loss falls.
  losses = [r['loss'] for r in got]
  assert losses == [r['loss'] for r in want]
  assert sum(losses[-5:]) / 5 < 0.7 * losses[0]
  summary = json.loads((tmp / 'run' / 'summary.json').read_text())
  assert summary['steps'] == 40
  assert summary['first_loss'] == losses[0]
  assert (tmp / 'run' / 'loss_curve.png').stat().st_size > 0
  checkpoints = checkpointing.RunCheckpointer(tmp / 'ckpt')
  assert checkpoints.latest_step() == 40


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, env):
  run_dir, ckpt_dir = tmp_path / 'run', tmp_path / 'ckpt'
  # 40 steps, as above: the same program, so the compilation is cached.
  args = [*_tiny(run_dir, ckpt_dir, 40), '--checkpoint-every=0']
  log = tmp_path / 'train.log'
  proc = _start(args, log, env)
  assert _wait_for_step(proc, run_dir, 3), log.read_text()
  proc.send_signal(signal.SIGTERM)
  out = _finish(proc, log)
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert 'Traceback' not in out
  assert 'SIGTERM: saving a checkpoint' in out
  assert 'mfu=' in out and 'tok_s=' in out  # The progress bar.
  steps_done = len(_metrics(run_dir))
  assert 4 <= steps_done < 40
  # One checkpoint, holding exactly the steps that were logged.
  saved = [int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()]
  assert saved == [steps_done]
  meta = checkpointing.RunCheckpointer(ckpt_dir).read_meta(steps_done)
  assert meta['step'] == steps_done
  assert meta['data_state']['index'] == steps_done * 4  # tiny: batch 4.
  assert (run_dir / 'loss_curve.png').exists()
  assert not (run_dir / 'summary.json').exists()  # Not finished.


def test_bad_preset_is_one_line_on_stderr(env):
  proc = subprocess.run(
    [*_TRAIN, '--preset=huge'],
    cwd=_ROOT,
    capture_output=True,
    text=True,
    timeout=_TIMEOUT_S,
    env=env,
  )
  assert proc.returncode == 2
  assert proc.stdout == ''
  assert proc.stderr.startswith('error: ')
  assert proc.stderr.count('\n') == 1, proc.stderr
  assert 'huge' in proc.stderr


def _error(argv, capsys) -> str:
  """Runs `main(argv)`, expects exit status 2, returns its one stderr line."""
  assert train.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and err.count('\n') == 1, err
  return err


def test_resume_refuses_a_different_model(killed_run, capsys):
  args, _ = killed_run
  err = _error([*args, '--resume', '--d-model=64'], capsys)
  assert 'different model' in err and 'd_model' in err
  # optax.adamw <-> superoffload converts (test_resume_switches_optimizer);
  # a run with gradient accumulation does not.
  err = _error(
    [*args, '--resume', '--optimizer=optax', '--grad-accum=2'], capsys
  )
  assert 'optimizer' in err
  err = _error([*args, '--resume', '--scan-layers'], capsys)
  assert 'scan_layers' in err


def test_fresh_run_refuses_a_used_checkpoint_dir(killed_run, capsys):
  args, _ = killed_run
  err = _error(args, capsys)
  assert 'already holds checkpoints' in err


def test_resume_without_a_checkpoint(tmp_path, capsys):
  err = _error(
    ['--preset=tiny', '--resume', f'--checkpoint-dir={tmp_path}'], capsys
  )
  assert 'no checkpoint' in err


@pytest.mark.parametrize(
  ('first', 'then'), [('optax', 'superoffload'), ('superoffload', 'optax')]
)
def test_resume_switches_optimizer(tmp_path, first, then):
  # Ten steps with one optimizer, checkpointed; two more with the other.
  # The first resumed step's loss is taken before its update, from the
  # restored params: it equals the uninterrupted run's. The next one comes
  # from the converted moments: equal up to the optimizers' fp32 rounding.
  def args(name, optimizer, steps):
    return [
      *_tiny(tmp_path / name, tmp_path / f'{name}_ckpt', steps),
      f'--optimizer={optimizer}',
      '--schedule=constant',  # The same learning rates, whatever --steps.
      '--no-progress',
    ]

  assert train.main(args('ref', first, 12)) == 0
  assert train.main(args('run', first, 10)) == 0
  resumed = args('run', then, 12)
  assert train.main([*resumed, '--resume']) == 0
  records = _metrics(tmp_path / 'run')
  first = min(r['step'] for r in records if r.get('resumed'))
  got = {r['step']: r['loss'] for r in records}
  want = {r['step']: r['loss'] for r in _metrics(tmp_path / 'ref')}
  assert got[first] == want[first]
  assert abs(got[first + 1] - want[first + 1]) < 1e-4 * abs(want[first + 1])
