"""jaxlib 0.12.1: a deserialized executable's collectives hang beside compiled.

No project code: two `jax.distributed` CPU processes (gloo) run
`jit(shard_map(psum))`, each from an executable it compiled or from the
same executable serialized and loaded back
(`jax.experimental.serialize_executable`, the persistent compilation
cache's path). On jaxlib 0.12.1 the all-reduce hangs in both processes
when one runs a loaded executable and the other a compiled one; two
loaded or two compiled ones meet. jaxlib 0.12.0.1 meets in every mix.

A shared persistent cache folder always mixes them: only process 0
writes the cache, and each process's cache key hashes its own devices, so
on a warm cache process 0 loads what the others compile. The trainer
turns the persistent cache off in its multi-process CPU runs where this
holds (`distributed.cache_hangs_collectives`).

A process prints ``at the call`` once its executable is ready; the
all-reduce of four floats then has `_CALL_S` seconds (a bound for a hang,
not a timing: it takes milliseconds).
"""

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

from experiments.trainer import distributed

_WORKER = """
import sys
import jax
import numpy as np
from jax.experimental import serialize_executable
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

port, pid, loaded = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(',')
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=2, process_id=pid)
mesh = Mesh(np.array(jax.devices()), ('data',))
x = jax.make_array_from_process_local_data(
  NamedSharding(mesh, P('data')), np.arange(4, dtype=np.float32)
)
f = jax.jit(
  jax.shard_map(
    lambda a: jax.lax.psum(a, 'data'),
    mesh=mesh,
    in_specs=P('data'),
    out_specs=P('data'),
  )
)
compiled = f.lower(x).compile()
if str(pid) in loaded:
  compiled = serialize_executable.deserialize_and_load(
    *serialize_executable.serialize(compiled)
  )
print('at the call', flush=True)
print('sum', np.asarray(compiled(x).addressable_data(0)).tolist(), flush=True)
jax.distributed.shutdown()
"""
# Seconds before both processes are at the call (a loaded machine), and
# for the call itself once they are.
_START_S = 300
_CALL_S = 60
_AFFECTED = distributed.jaxlib_version() >= (0, 12, 1)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _run(loaded: str, tmp_path) -> list[str]:
  """Both processes' output; `loaded` names those that load (e.g. '0')."""
  env = dict(os.environ)
  env.update(
    XLA_FLAGS='--xla_force_host_platform_device_count=1', JAX_PLATFORMS='cpu'
  )
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  port = _free_port()
  logs = [tmp_path / f'process{i}.log' for i in range(2)]
  procs = []
  for i, log in enumerate(logs):
    with open(log, 'w') as out:
      procs.append(
        subprocess.Popen(
          [sys.executable, '-c', _WORKER, str(port), str(i), loaded or '-'],
          env=env,
          stdout=out,
          stderr=subprocess.STDOUT,
          # Its own group: jax.distributed catches SIGTERM.
          start_new_session=True,
        )
      )
  try:
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline and not all(
      'at the call' in log.read_text() or p.poll() is not None
      for log, p in zip(logs, procs, strict=True)
    ):
      time.sleep(0.5)
    deadline = min(deadline, time.monotonic() + _CALL_S)
    for p in procs:
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
        p.wait()
  return [log.read_text() for log in logs]


def _sums(outs: list[str]) -> list[str]:
  return [
    line for out in outs for line in out.splitlines() if line.startswith('sum ')
  ]


@pytest.mark.parametrize('loaded', ['', '0,1'], ids=['compiled', 'loaded'])
def test_two_of_a_kind_meet(loaded, tmp_path):
  outs = _run(loaded, tmp_path)
  assert _sums(outs) == ['sum [0.0, 2.0, 4.0, 6.0]'] * 2, outs


@pytest.mark.xfail(
  _AFFECTED,
  reason='jaxlib 0.12.1: a loaded executable and a compiled one hang in '
  'their cross-process all-reduce',
  strict=True,
)
@pytest.mark.parametrize('loaded', ['0', '1'])
def test_a_loaded_and_a_compiled_executable_meet(loaded, tmp_path):
  outs = _run(loaded, tmp_path)
  assert _sums(outs) == ['sum [0.0, 2.0, 4.0, 6.0]'] * 2, outs
