"""ZeRO training across 2 processes (jax.distributed, CPU) vs 1 process.

Also the multi-process trainer's small parts: digests, bind address, the
private jax API it isolates.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.trainer import config as config_lib
from experiments.trainer import config_cli
from experiments.trainer import digests
from experiments.trainer import distributed
from experiments.trainer import liveness
from experiments.trainer import train

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


# Digests (checkpoint integrity without gathering), the coordinator's bind
# address, and the private jax API behind `liveness`.


def _reference_digest(x: np.ndarray) -> int:
  """The digest's definition in plain Python integers, element by element."""
  mask = 2**64 - 1
  bits = np.ascontiguousarray(x).view(f'u{x.dtype.itemsize}').reshape(-1)
  total = 0
  for i, b in enumerate(bits.tolist()):
    z = ((i * 0x9E3779B97F4A7C15) & mask) ^ b
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    total += z ^ (z >> 31)
  return total & mask


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16', 'int8', 'uint32'])
def test_digest_is_the_same_however_the_array_is_sharded(dtype):
  x = (np.arange(8 * 6, dtype=np.float32).reshape(8, 6) - 7).astype(dtype)
  want = _reference_digest(x)
  devices = np.array(jax.devices()[:8])
  layouts = [
    (devices.reshape(8, 1), P('a', None)),
    (devices.reshape(4, 2), P('a', 'b')),
    (devices.reshape(2, 4), P(None, 'a')),  # Replicated over 'b'.
    (devices.reshape(8, 1), P()),  # Replicated: counted once.
  ]
  for grid, spec in layouts:
    mesh = Mesh(grid, ('a', 'b'))
    sharded = jax.device_put(x, NamedSharding(mesh, spec))
    assert digests.local_digest(sharded) == want, spec
  assert digests.local_digest(x) == want  # A NumPy array.
  assert digests.global_digests([x, x]) == [want, want]  # One process.


def test_digest_sees_one_changed_element_and_two_swapped():
  x = np.arange(64, dtype=np.float32)
  changed = x.copy()
  changed[17] = np.nextafter(changed[17], np.inf)  # One bit.
  swapped = x.copy()
  swapped[[3, 40]] = swapped[[40, 3]]
  got = {digests.local_digest(v) for v in (x, changed, swapped)}
  assert len(got) == 3


@pytest.mark.parametrize(
  'coordinator, bind, env, want',
  [
    ('127.0.0.1:1234', None, None, '127.0.0.1:1234'),
    ('localhost:1234', None, None, 'localhost:1234'),
    ('[::1]:1234', None, None, '[::1]:1234'),
    ('10.0.0.1:1234', None, None, None),  # jax's default: [::]:1234.
    ('10.0.0.1:1234', None, '10.0.0.1:1234', '10.0.0.1:1234'),
    ('127.0.0.1:1234', None, '0.0.0.0:1234', '0.0.0.0:1234'),
    ('10.0.0.1:1234', '10.0.0.2:1234', None, '10.0.0.2:1234'),
    ('127.0.0.1:1234', '0.0.0.0:1234', '10.0.0.1:1', '0.0.0.0:1234'),
  ],
)
def test_coordinator_binds_where_asked(
  monkeypatch, coordinator, bind, env, want
):
  monkeypatch.delenv(distributed.BIND_ENV, raising=False)
  if env is not None:
    monkeypatch.setenv(distributed.BIND_ENV, env)
  assert distributed.bind_address(coordinator, bind) == want


def _without_bind_env(monkeypatch) -> None:
  """`BIND_ENV` unset, and restored after the test whatever sets it."""
  monkeypatch.setenv(distributed.BIND_ENV, 'restored-after-the-test')
  monkeypatch.delenv(distributed.BIND_ENV)


@pytest.mark.parametrize(
  'argv',
  [
    ['--config.coordinator_bind=h:1'],
    ['--coordinator-bind', 'h:1'],  # The older spelling, with a note.
    ['--coordinator-bind=h:1', '--zero'],
  ],
)
def test_coordinator_bind_is_a_config_field(monkeypatch, argv):
  _without_bind_env(monkeypatch)
  cfg, old = config_cli.parse(['--config=tiny', *argv])
  assert cfg.coordinator_bind == 'h:1'
  assert ('--coordinator-bind' in old) == argv[0].startswith('--coordinator')
  # Parsing leaves the environment alone: a variable set in the test
  # process reached every later test's trainers (the "g:2" coordinator).
  assert distributed.BIND_ENV not in os.environ


def test_coordinator_bind_errors_are_one_line(monkeypatch, capsys):
  _without_bind_env(monkeypatch)
  with pytest.raises(config_lib.ConfigError, match='needs a value'):
    config_cli.parse(['--coordinator-bind'])
  bad = config_lib.get_config('tiny', coordinator_bind='nohost')
  with pytest.raises(config_lib.ConfigError, match='coordinator_bind must'):
    config_lib.validate(bad)
  # The whole command line, refused before any process starts.
  argv = ['--config=tiny', '--coordinator-bind=g:2', '--config.zero']
  assert train.main([*argv, '--config.coordinator=127.0.0.1:1']) == 2
  assert capsys.readouterr().err.count('\n') == 1
  assert distributed.BIND_ENV not in os.environ


def test_the_private_jax_api_is_there():
  # On this jax (the CI runs 0.10.2 and 0.12.1): present, and explicit
  # about what is missing when it is not.
  assert liveness.coordinator_address() is None  # Not initialized here.
  with pytest.raises(liveness.MissingJaxAPIError, match='not initialized'):
    liveness.coordination_client()


def test_a_missing_private_api_is_named(monkeypatch):
  from jax._src import distributed as private

  monkeypatch.delattr(private, 'global_state')
  with pytest.raises(liveness.MissingJaxAPIError) as e:
    liveness.coordination_client()
  assert 'global_state' in str(e.value) and jax.__version__ in str(e.value)


def test_an_injected_exception_a_library_lost_is_raised_at_the_next_step(
  monkeypatch,
):
  # The chaos rounds' "exception" kind: SIGUSR1's handler raises wherever
  # the main thread is, and code that drops exceptions can lose it (round
  # 39 of 100 trained to the end). The loop raises it again at a step.
  monkeypatch.setenv(distributed.RAISE_ENV, '1')
  before = signal.getsignal(signal.SIGUSR1)
  try:
    distributed._install_test_hooks()
    distributed.raise_if_asked()  # Nothing asked yet.
    try:
      os.kill(os.getpid(), signal.SIGUSR1)
      for _ in range(1000):
        time.sleep(0.001)
    except RuntimeError:
      pass  # Lost, as a library's broad `except` would lose it.
    with pytest.raises(RuntimeError, match='as asked'):
      distributed.raise_if_asked()
  finally:
    signal.signal(signal.SIGUSR1, before)
    distributed._RAISE_ASKED.clear()
