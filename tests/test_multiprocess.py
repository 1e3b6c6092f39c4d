"""ZeRO training across 2 processes (jax.distributed, CPU) vs 1 process."""

import json
import os
import pathlib
import socket
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name('zero_worker.py')
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _env():
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)  # The worker sets its own device count.
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _check(proc: subprocess.Popen, what: str) -> None:
  try:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
  assert proc.returncode == 0, f'{what} failed:\n{out[-4000:]}'


def test_two_processes_equal_one_process_with_two_devices(tmp_path):
  port = _free_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        str(WORKER),
        str(tmp_path / f'proc{i}.json'),
        f'--coordinator=127.0.0.1:{port}',
        '--num-processes=2',
        f'--process-id={i}',
      ],
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  single = subprocess.Popen(
    [
      sys.executable,
      str(WORKER),
      str(tmp_path / 'single.json'),
      '--local-devices=2',
    ],
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  for i, p in enumerate(procs):
    _check(p, f'process {i}')
  _check(single, 'the single process')

  runs = [json.loads((tmp_path / f'proc{i}.json').read_text()) for i in (0, 1)]
  ref = json.loads((tmp_path / 'single.json').read_text())
  assert ref['process_count'] == 1 and ref['device_count'] == 2
  for run in runs:
    assert run['process_count'] == 2 and run['device_count'] == 2
    # Each process holds one half of every bucket, in pinned host memory.
    for bucket in run['state']:
      assert bucket['memory_kind'] == 'pinned_host'
      assert bucket['local_shard_sizes'] == [bucket['size'] // 2]
    # Bit for bit: a two-way all-reduce adds the same two numbers, whether
    # gloo does it across processes or XLA across local devices.
    assert run['losses'] == ref['losses']
    assert run['params'] == ref['params']
  assert ref['losses'][-1] < 0.7 * ref['losses'][0]
  # Both processes ran the same replicated training step.
  assert runs[0]['losses'] == runs[1]['losses']
