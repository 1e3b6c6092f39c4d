"""The backend the optimizer builds its program for.

Every choice the library makes from the backend (which executor "auto"
means, whether the CPU-only in-place ordering applies, which hardware
profile "auto" plans for) asks `target()`, never `jax.default_backend()`
directly. That lets a program be traced for a GPU on a machine without one
(deviceless compilation: trace on the CPU, compile for CUDA) inside
`compiling_for('gpu')`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
  'jax_superoffload_target_backend', default=None
)
_PLATFORMS = ('cpu', 'gpu', 'tpu')


def target() -> str:
  """The backend being built for: `compiling_for`'s, else JAX's default."""
  return _TARGET.get() or jax.default_backend()


def cross_compiling() -> bool:
  """Whether `compiling_for` names a backend other than JAX's default."""
  return _TARGET.get() not in (None, jax.default_backend())


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
  """Traces the optimizer as for `platform` while JAX runs on another.

  For deviceless compilation: the step is traced and lowered on the CPU
  backend (whose devices have `pinned_host` memory) and compiled for the
  GPU by a compile-only client. Inside this context the library's
  backend-dependent choices follow `platform`, and on 'gpu' the stream
  executor's CUDA handlers are filed without a CUDA driver (they are only
  compiled against, never run). Nothing here makes the program run on
  `platform`: a program traced inside it is for compilation only.

  Args:
    platform: 'gpu', 'tpu' or 'cpu', as `jax.default_backend()` names them.

  Raises:
    ValueError: For another name.
  """
  if platform not in _PLATFORMS:
    raise ValueError(f'platform must be one of {_PLATFORMS}, got {platform!r}')
  token = _TARGET.set(platform)
  try:
    yield
  finally:
    _TARGET.reset(token)
