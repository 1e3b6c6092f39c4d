"""The independent memory limit of an AdamW step, compiled apart and timed.

`stream_limit.c` beside this file shares no code with the Grace Adam kernel:
it is compiled here, on the machine that runs the benchmark, by the system C
compiler with its own vectorisation for this CPU, and loaded with ctypes.
Each variant moves the 28 bytes per parameter of an in-place AdamW step with
no Adam math; the fastest variant of a run is the limit.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable

import numpy as np

SOURCE = pathlib.Path(__file__).with_name('stream_limit.c')
FLAGS = ('-O3', '-march=native', '-std=c11', '-pthread', '-shared', '-fPIC')
VARIANTS = {
  'plain': 0,
  'prefetch t0': 1,
  'prefetch nta': 2,
  'streaming stores': 3,
}


def _compiler() -> str:
  for name in (os.environ.get('CC'), 'cc', 'gcc', 'clang'):
    if name and shutil.which(name):
      return name
  raise RuntimeError('no C compiler found (set CC) to build the stream limit')


def build(cache_dir: str = 'build/stream_limit') -> tuple[ctypes.CDLL, str]:
  """Compiles stream_limit.c (cached by source and flags); returns it loaded.

  Also returns the compile command, for the benchmark's record.
  """
  cc = _compiler()
  key = hashlib.sha256(
    SOURCE.read_bytes() + ' '.join((cc, *FLAGS)).encode()
  ).hexdigest()[:16]
  out = pathlib.Path(cache_dir) / f'stream_limit_{key}.so'
  command = [cc, *FLAGS, str(SOURCE), '-o']
  if not out.exists():
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: two benchmarks never see half
    # a library.
    with tempfile.NamedTemporaryFile(
      dir=out.parent, suffix='.so', delete=False
    ) as tmp:
      pass
    subprocess.run([*command, tmp.name], check=True)
    os.replace(tmp.name, out)
  lib = ctypes.CDLL(str(out.resolve()))
  lib.stream_limit_alloc.restype = ctypes.c_void_p
  lib.stream_limit_alloc.argtypes = [ctypes.c_int64]
  lib.stream_limit_free.argtypes = [ctypes.c_void_p]
  lib.stream_limit_stream.restype = ctypes.POINTER(ctypes.c_float)
  lib.stream_limit_stream.argtypes = [ctypes.c_void_p, ctypes.c_int]
  lib.stream_limit_pass.restype = ctypes.c_int
  lib.stream_limit_pass.argtypes = [
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
  ]
  return lib, ' '.join([*command, out.name])


class StreamLimit:
  """The limit's streams of `n` floats (rounded up to whole 64-byte lines).

  `runs` maps each variant this build has to a callable that makes one pass
  on `threads` threads, moving `moment_bytes` (4, 2 or 1) per element of
  each moment: 28, 20 or 16 bytes per element in all. `stream(k)` views
  stream k (0 master, 1 grad, 2 mu, 3 nu) as a NumPy array, for tests.
  """

  def __init__(
    self, lib: ctypes.CDLL, n: int, threads: int, moment_bytes: int = 4
  ):
    unit = 16 if moment_bytes == 4 else 64  # Elements per step of a pass.
    self.n = -(-n // unit) * unit
    self.moment_bytes = moment_bytes
    self.bytes_per_param = 12 + 4 * moment_bytes
    self._lib = lib
    self._threads = threads
    self._handle = lib.stream_limit_alloc(self.n)
    if not self._handle:
      raise MemoryError(f'stream limit: cannot allocate 4 x {self.n} floats')
    names = dict(VARIANTS)
    if not lib.stream_limit_has_streaming_stores():
      del names['streaming stores']
    self.runs = {name: self._pass(code) for name, code in names.items()}

  def _pass(self, code: int) -> Callable[[], None]:
    def run() -> None:
      if (
        self._lib.stream_limit_pass(
          self._handle, code, self._threads, self.moment_bytes
        )
        != 0
      ):
        raise RuntimeError('stream limit pass failed')

    return run

  def stream(self, k: int) -> np.ndarray:
    """Stream k as a NumPy view (0 master, 1 grad, 2 mu, 3 nu)."""
    pointer = self._lib.stream_limit_stream(self._handle, k)
    return np.ctypeslib.as_array(pointer, (self.n,))

  def __del__(self):
    if getattr(self, '_handle', None):
      self._lib.stream_limit_free(self._handle)
      self._handle = None
