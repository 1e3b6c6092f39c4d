"""Ctrl-C, once and twice, sent to a real trainer process.

Once: the trainer saves a checkpoint and stops, and its ``stopped:`` line
names the step of the evaluation it shows. Twice, while that save is being
written: one line, no traceback, exit 130 at once; the save's temporary
folder stays behind, and the next ``--resume`` names it as it removes it.

To land the second Ctrl-C inside the save for certain, the trainer runs
under a wrapper that holds Orbax's commit (the rename of the temporary
folder, `atomicity.on_commit_callback`, which Orbax's background thread
calls) once a flag file exists, and says so on stderr.
"""

import json
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_CORPUS = 'the quick brown fox jumps over the lazy dog. ' * 400
_TIMEOUT_S = 300
_HOLDING = 'test: holding the commit of a save'
# Runs the trainer (argv: its flags) with Orbax's commit held while the file
# named by the first argument exists.
_WRAPPER = f"""
import pathlib, sys, threading
from orbax.checkpoint._src.path import atomicity
flag = pathlib.Path(sys.argv.pop(1))
commit = atomicity.on_commit_callback
async def held(*args, **kwargs):
  if flag.exists():
    sys.stderr.write({_HOLDING!r} + '\\n')
    sys.stderr.flush()
    threading.Event().wait()
  return await commit(*args, **kwargs)
atomicity.on_commit_callback = held
from experiments.trainer import train
sys.exit(train.main(sys.argv[1:]))
"""
# Orbax's asyncio, cut off: what must never reach the user.
_NOISE = ('Traceback', 'never awaited', 'Event loop is closed')


def _args(tmp: pathlib.Path) -> list[str]:
  return [
    f'--config={_ROOT / "configs" / "tiny.py"}',
    '--config.optimizer=superoffload',
    f'--config.data={tmp / "corpus.txt"}',
    f'--config.out_dir={tmp / "run"}',
    '--config.steps=100000',
    '--config.checkpoint_every=4',
    '--config.eval_every=3',
    '--config.peak_tflops=1',
    '--noconfig.progress',
    '--noconfig.tensorboard',
  ]


# The trainers started, killed at the end of the module if still running.
_STARTED: list[subprocess.Popen] = []


def _start(tmp: pathlib.Path, name: str, *flags: str) -> subprocess.Popen:
  with (
    open(tmp / f'{name}.out', 'w') as out,
    open(tmp / f'{name}.err', 'w') as err,
  ):
    proc = subprocess.Popen(
      [sys.executable, '-c', _WRAPPER, str(tmp / 'hold'), *_args(tmp), *flags],
      cwd=_ROOT,
      stdout=out,
      stderr=err,
    )
  _STARTED.append(proc)
  return proc


def _wait_for(proc: subprocess.Popen, ready, what: str) -> None:
  deadline = time.monotonic() + _TIMEOUT_S
  while not ready():
    assert proc.poll() is None, f'trainer exited {proc.returncode}: {what}'
    assert time.monotonic() < deadline, f'timed out: {what}'
    time.sleep(0.05)


def _steps_done(tmp: pathlib.Path) -> int:
  path = tmp / 'run' / 'metrics.jsonl'
  return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope='module')
def double_interrupt(tmp_path_factory):
  """A run interrupted twice while saving, then resumed and stopped once."""
  try:
    yield _interrupt_twice_then_once(tmp_path_factory.mktemp('interrupts'))
  finally:
    for proc in _STARTED:  # Left running by a failure (a hang, say).
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def _interrupt_twice_then_once(tmp: pathlib.Path):
  (tmp / 'corpus.txt').write_text(_CORPUS)
  ckpt = tmp / 'run' / 'checkpoints'
  first = _start(tmp, 'first')
  _wait_for(first, lambda: (ckpt / '4').is_dir(), 'checkpoint 4')
  _wait_for(first, lambda: _steps_done(tmp) >= 6, 'step 6')
  (tmp / 'hold').touch()
  first.send_signal(signal.SIGINT)
  held = lambda: _HOLDING in (tmp / 'first.err').read_text()  # noqa: E731
  _wait_for(first, held, 'the save held')
  left = sorted(p.name for p in ckpt.iterdir() if 'tmp' in p.name)
  first.send_signal(signal.SIGINT)
  code = first.wait(_TIMEOUT_S)
  (tmp / 'hold').unlink()
  # Resumed; stopped by one SIGINT after its first evaluation.
  second = _start(tmp, 'second', '--config.resume')
  resumed = _steps_done(tmp)
  _wait_for(second, lambda: _steps_done(tmp) >= resumed + 4, 'resumed steps')
  second.send_signal(signal.SIGINT)
  return tmp, code, left, second.wait(_TIMEOUT_S)


def test_second_ctrl_c_during_a_save_is_one_line(double_interrupt):
  tmp, code, left, _ = double_interrupt
  assert code == 128 + signal.SIGINT
  out = (tmp / 'first.out').read_text()
  err = (tmp / 'first.err').read_text()
  for noise in _NOISE:
    assert noise not in out + err, out + err
  lines = [x for x in err.splitlines() if x != _HOLDING]
  assert len(lines) == 1, err
  m = re.fullmatch(
    r'SIGINT again: abandoned the save of step (\d+) \(the next --resume '
    r'removes what it wrote\); the newest complete checkpoint is step (\d+)',
    lines[0],
  )
  assert m, lines[0]
  step, kept = int(m.group(1)), int(m.group(2))
  if step % 4:  # Else the periodic save of that step was the one held.
    assert f'SIGINT: saving a checkpoint at step {step} and stopping' in out
  assert kept == 4 * ((step - 1) // 4)
  # Orbax's temporary folder of that step was left as it was.
  assert [name.split('.')[0] for name in left] == [str(step)], left


def test_resume_names_the_abandoned_save(double_interrupt):
  tmp, _, left, _ = double_interrupt
  out = (tmp / 'second.out').read_text()
  assert (
    f'note: removed the unfinished save of an interrupted run: step '
    f'{left[0].split(".")[0]} ({left[0]})'
  ) in out, out
  ckpt = tmp / 'run' / 'checkpoints'
  assert not [p for p in ckpt.iterdir() if 'tmp' in p.name]


def test_one_ctrl_c_saves_and_the_stopped_line_names_the_eval_step(
  double_interrupt,
):
  tmp, _, _, code = double_interrupt
  assert code == 128 + signal.SIGINT
  out = (tmp / 'second.out').read_text()
  err = (tmp / 'second.err').read_text()
  for noise in _NOISE:
    assert noise not in out + err, out + err
  records = [json.loads(x) for x in (tmp / 'run' / 'metrics.jsonl').open()]
  evals = [r for r in records if 'eval_loss' in r]
  last = evals[-1]
  stopped = [x for x in out.splitlines() if x.startswith('stopped:')]
  assert len(stopped) == 1, out
  assert (
    f'eval {last["eval_loss"]:.4f} ({last["eval_bpb"]:.3f} bpb) at step '
    f'{last["eval_step"]}'
  ) in stopped[0]
  # Each evaluation was on the console too, as it happened.
  resumed_at = next(r['step'] for r in records if r.get('resumed'))
  for r in evals:
    if r['step'] >= resumed_at:
      assert f'at step {r["eval_step"]}' in out
  # The save of the stop committed: the newest checkpoint is its step.
  ckpt = tmp / 'run' / 'checkpoints'
  steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  assert steps[-1] == len(records)
