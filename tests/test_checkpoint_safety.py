"""Checkpoints the trainer can trust: damage, shared folders, copied runs.

Each test is one failure a user met: a damaged newest checkpoint,
two trainers on one checkpoint folder, a copied run folder, an unwritable
folder, and failed starts leaving empty run folders behind.
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

from experiments.trainer import checkpointing
from experiments.trainer import folder_lock
from experiments.trainer import train

# Orbax's asyncio cut off mid-way ("coroutine ... was never awaited",
# "Event loop is closed", reported when the objects are collected) must not
# escape: as errors, they fail the test that leaves them.
pytestmark = [
  pytest.mark.filterwarnings(
    'error:coroutine .* was never awaited:RuntimeWarning'
  ),
  pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
]

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_CORPUS = 'the quick brown fox jumps over the lazy dog. ' * 400
_TIMEOUT_S = 300


def _args(tmp: pathlib.Path, run: str, steps: int = 10, every: int = 5):
  data = tmp / 'corpus.txt'
  if not data.exists():
    data.write_text(_CORPUS)
  return [
    '--preset=tiny',
    '--optimizer=superoffload',
    f'--data={data}',
    f'--out-dir={tmp / run}',
    f'--steps={steps}',
    f'--checkpoint-every={every}',
    '--no-progress',
    '--no-tensorboard',
    '--peak-tflops=1',  # MFU against a stated peak on any machine.
  ]


def _metrics(run_dir: pathlib.Path) -> list[dict]:
  lines = (run_dir / 'metrics.jsonl').read_text().splitlines()
  return [json.loads(line) for line in lines]


def _steps(directory: pathlib.Path) -> list[int]:
  """The complete checkpoints of a folder; the checkpointer closed after."""
  checkpointer = checkpointing.RunCheckpointer(directory)
  try:
    return checkpointer.all_steps()
  finally:
    checkpointer.close()


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  assert err.startswith('error: ') and err.count('\n') == 1, err
  return err


@pytest.fixture(scope='module')
def saved_run(tmp_path_factory):
  """A 10-step run with checkpoints at steps 5 and 10, in its run folder."""
  tmp = tmp_path_factory.mktemp('saved')
  assert train.main(_args(tmp, 'run')) == 0
  return tmp / 'run'


def _largest_data_file(step_dir: pathlib.Path) -> pathlib.Path:
  files = [p for p in (step_dir / 'state').rglob('*') if p.is_file()]
  return max(files, key=lambda p: p.stat().st_size)


def _truncate(path: pathlib.Path) -> None:
  os.truncate(path, path.stat().st_size // 2)


def _delete(path: pathlib.Path) -> None:
  path.unlink()


def _flip_400_bytes(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  for i in range(middle, middle + 400):
    data[i] ^= 0x5A
  path.write_bytes(bytes(data))  # Same size, same name.


def _change_one_recorded_checksum(step_dir: pathlib.Path) -> None:
  path = step_dir / 'meta' / 'metadata'
  meta = json.loads(path.read_text())
  key = sorted(meta['checksums'])[0]
  meta['checksums'][key] ^= 1
  path.write_text(json.dumps(meta))


@pytest.mark.parametrize('damage', [_truncate, _delete, _flip_400_bytes])
def test_damaged_newest_checkpoint_resumes_from_the_older_one(
  saved_run, tmp_path, damage, capsys
):
  copy = tmp_path / 'run'
  shutil.copytree(saved_run, copy)
  damage(_largest_data_file(copy / 'checkpoints' / '10'))
  capsys.readouterr()
  # Same total steps: resumed from step 5, the losses repeat bit for bit.
  argv = [*_args(tmp_path, 'run'), '--resume']
  assert train.main(argv) == 0
  out = capsys.readouterr().out
  notes = [x for x in out.splitlines() if x.startswith('note: damaged')]
  assert len(notes) == 1, out
  assert 'step 10' in notes[0] and 'resuming from step 5' in notes[0]
  got, want = _metrics(copy), _metrics(saved_run)
  assert [r['step'] for r in got] == list(range(10))
  assert [r['loss'] for r in got] == [r['loss'] for r in want]
  assert [r['step'] for r in got if r.get('resumed')] == [5]
  # The damaged step was set aside and saved again, intact.
  assert _steps(copy / 'checkpoints') == [10, 5]


def test_no_intact_checkpoint_is_one_line(saved_run, tmp_path, capsys):
  copy = tmp_path / 'run'
  shutil.copytree(saved_run, copy)
  # Flipped bytes fail either the read (compressed chunks) or the checksum,
  # depending on the TensorStore build; a changed recorded checksum fails the
  # checksum always.
  _flip_400_bytes(_largest_data_file(copy / 'checkpoints' / '10'))
  _change_one_recorded_checksum(copy / 'checkpoints' / '5')
  capsys.readouterr()
  argv = [
    *_args(tmp_path, 'elsewhere'),
    '--resume',
    f'--checkpoint-dir={copy / "checkpoints"}',
  ]
  assert train.main(argv) == 2
  err = _one_error_line(capsys)
  assert 'no intact checkpoint' in err
  assert 'step 10: ' in err and 'step 5: ' in err
  assert 'fails its checksum' in err.split('step 5: ')[1]
  # The run folder it would have written was created, then removed.
  assert not (tmp_path / 'elsewhere').exists()
  assert not (copy / 'checkpoints' / '.lock').exists()


def test_copied_run_folder_resumes_in_place(saved_run, tmp_path):
  copy = tmp_path / 'copied'
  shutil.copytree(saved_run, copy)
  before = (saved_run / 'metrics.jsonl').read_text()
  argv = [
    *_args(tmp_path, 'unused', steps=12),
    '--resume',
    f'--checkpoint-dir={copy / "checkpoints"}',
  ]
  argv.remove(f'--out-dir={tmp_path / "unused"}')
  assert train.main(argv) == 0
  assert [r['step'] for r in _metrics(copy)] == list(range(12))
  assert (saved_run / 'metrics.jsonl').read_text() == before
  assert not (tmp_path / 'unused').exists()


def test_unwritable_checkpoint_folder_is_refused_before_step_0(
  tmp_path, capsys, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  argv = [*_args(tmp_path, 'run'), '--checkpoint-dir=/proc/no/such/folder']
  assert train.main(argv) == 2
  err = _one_error_line(capsys)
  assert 'not writable' in err and '/proc/no/such/folder' in err
  assert not (tmp_path / 'run').exists()  # No step ran, nothing was left.


@pytest.mark.parametrize('case', ['small vocab', 'used checkpoint folder'])
def test_failed_starts_leave_no_run_folder(
  saved_run, tmp_path, case, capsys, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  (tmp_path / 'corpus.txt').write_text(_CORPUS)
  flags = {
    'small vocab': ['--vocab-size=10'],  # Refused after reading the data.
    # Refused after taking the lock of a folder that holds checkpoints.
    'used checkpoint folder': [f'--checkpoint-dir={saved_run}/checkpoints'],
  }[case]
  argv = ['--preset=tiny', '--data=corpus.txt', '--no-progress', *flags]
  assert train.main(argv) == 2
  _one_error_line(capsys)
  assert not (tmp_path / 'runs').exists()
  assert not (saved_run / 'checkpoints' / '.lock').exists()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, capsys):
  ckpt = tmp_path / 'run' / 'checkpoints'
  ckpt.mkdir(parents=True)
  dead = subprocess.Popen(['true'])
  dead.wait()
  owner = {'pid': dead.pid, 'host': socket.gethostname(), 'since': 'then'}
  (ckpt / '.lock').write_text(json.dumps(owner))
  assert train.main(_args(tmp_path, 'run', steps=5)) == 0
  out = capsys.readouterr().out
  assert f'took over the stale lock of process {dead.pid}' in out
  assert not (ckpt / '.lock').exists()  # Released at the end.


def test_lock_of_a_killed_unreaped_process_is_taken_over(tmp_path):
  # A trainer killed by SIGKILL whose parent has not waited for it yet (a
  # zombie): the kernel dropped its flock, and its PID still answers.
  ckpt = tmp_path / 'ckpt'
  holder = subprocess.Popen(
    [
      sys.executable,
      '-c',
      'import sys; from experiments.trainer import folder_lock; '
      f'folder_lock.FolderLock({str(ckpt)!r}).acquire(); '
      'print("locked", flush=True); sys.stdin.read()',
    ],
    cwd=_ROOT,
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  assert holder.stdout.readline() == 'locked\n'
  with pytest.raises(ValueError, match=f'PID {holder.pid}'):
    folder_lock.FolderLock(ckpt).acquire()
  holder.kill()
  # Not waited for: a zombie once all its threads are gone (the kernel
  # drops the flock with the last one).
  lock = folder_lock.FolderLock(ckpt)
  deadline = time.monotonic() + 30
  while True:
    try:
      note = lock.acquire()
      break
    except ValueError:
      assert time.monotonic() < deadline
      time.sleep(0.05)
  assert folder_lock._is_zombie(holder.pid)
  assert f'process {holder.pid}' in note
  lock.release()
  holder.wait()
  holder.stdin.close()
  holder.stdout.close()


def test_second_writer_is_refused_while_the_first_finishes_intact(
  tmp_path, capsys
):
  # Long enough (100 steps, 4 saves) to still run when the second starts.
  first_args = _args(tmp_path, 'first', steps=100, every=25)
  log = tmp_path / 'first.log'
  with open(log, 'w') as out:
    first = subprocess.Popen(
      [sys.executable, '-m', 'experiments.trainer', *first_args],
      cwd=_ROOT,
      stdout=out,
      stderr=out,
    )
  metrics = tmp_path / 'first' / 'metrics.jsonl'
  deadline = time.monotonic() + _TIMEOUT_S
  while not metrics.exists() or not metrics.read_text():
    assert first.poll() is None, log.read_text()
    assert time.monotonic() < deadline
    time.sleep(0.01)
  # Frozen while the second trainer tries: the first one surely holds it.
  first.send_signal(signal.SIGSTOP)
  try:
    second_args = [
      *_args(tmp_path, 'second', steps=100, every=25),
      f'--checkpoint-dir={tmp_path / "first" / "checkpoints"}',
    ]
    assert train.main(second_args) == 2
    err = _one_error_line(capsys)
    assert 'in use by another trainer' in err
    assert f'PID {first.pid}' in err
  finally:
    first.send_signal(signal.SIGCONT)
  assert first.wait(_TIMEOUT_S) == 0, log.read_text()
  for noise in ('Traceback', 'never awaited', 'Event loop is closed'):
    assert noise not in log.read_text()
  assert not (tmp_path / 'second').exists()
  assert [r['step'] for r in _metrics(tmp_path / 'first')] == list(range(100))
  assert _steps(tmp_path / 'first' / 'checkpoints') == [100, 75, 50]
  summary = json.loads((tmp_path / 'first' / 'summary.json').read_text())
  assert summary['checkpoint_dir'] == str(tmp_path / 'first' / 'checkpoints')
  # Every array of its newest checkpoint passes its checksum.
  capsys.readouterr()
  assert train.main([*first_args, '--resume']) == 0
  out = capsys.readouterr().out
  assert 'at step 100' in out and 'damaged' not in out
