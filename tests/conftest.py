"""Test setup, before JAX is imported anywhere.

- 8 fake CPU devices.
- One XLA compilation cache for the run. Tests build their own optimizers,
  so jit's in-memory cache sees the same small programs as new ones again
  and again; JAX's persistent cache, in a folder the run's pytest workers
  and the trainer processes tests start all share, compiles each of them
  once. The folder is made for this run (cold at its start) and removed at
  its end, so no test reads an executable another tree compiled. A cache
  folder set in the environment is used as it is.
"""

import os
import shutil
import tempfile

os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()

_RUN_CACHE = None
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  # Set before pytest-xdist starts its workers, which inherit it.
  _RUN_CACHE = tempfile.mkdtemp(prefix='jax_superoffload-xla-cache-')
  os.environ.update(
    JAX_COMPILATION_CACHE_DIR=_RUN_CACHE,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
  )


def pytest_unconfigure(config) -> None:
  """Removes the run's compilation cache (in the process that made it)."""
  del config
  if _RUN_CACHE is not None:
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)
