"""Compiles a jitted function for an NVIDIA GPU on a machine without one.

The recipe (JAX's own `tests/aot_test.py::test_deviceless_aot_compile`, and
the CUDA plugin's `GetTargetConfigFromOptions`):

1. `jax.experimental.topologies.get_topology_desc(platform='cuda',
   target_config=...)` makes the CUDA PJRT plugin build compile-only
   devices from a description of the GPU (`gpu_targets.py`), touching no
   driver. It needs the plugin wheels (`jax-cuda13-plugin`,
   `jax-cuda13-pjrt`) and ptxas and libdevice (`nvidia-cuda-nvcc`,
   `nvidia-nvvm`): `make aot-deps` unpacks them beside the venv, and
   `add_plugin_path()` puts them on `sys.path` before JAX starts.
2. Compile-only devices have no memory spaces, and JAX silently drops
   `memory_kind='pinned_host'` on them. So the function is traced and
   lowered on CPU devices (which have `pinned_host`) with
   `lowering_platforms=('cuda',)`, and the CUDA module is handed to the
   compile-only client. That step uses JAX's private API (the lowering's
   `compile_args` and `pxla._cached_compilation`), checked on the versions
   in `CHECKED_JAX`; another version gets a warning, not a guess.
3. No autotuning runs without a GPU: GEMM and fusion configurations are
   XLA's defaults. What compiles, the optimized HLO and its schedule, the
   streams, the copies and `memory_analysis()` are real; no time is.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

# The JAX versions this module's private-API step is checked on.
CHECKED_JAX = ('0.11.2', '0.12.0.1', '0.12.1')
_ROOT = pathlib.Path(__file__).resolve().parents[2]
PLUGIN_PATH_ENV = 'JAX_SUPEROFFLOAD_CUDA_AOT'
# jax_superoffload's plugin_ffi.PLUGIN_ENV (not imported: JAX must not be
# imported before `add_plugin_path`).
_REGISTER_IN_ENV = 'JAX_SUPEROFFLOAD_CUDA_PLUGIN'


def plugin_path() -> pathlib.Path:
  """Where `make aot-deps` unpacked the CUDA plugin and compiler wheels."""
  default = _ROOT / '.venv312' / 'cuda-aot'
  return pathlib.Path(os.environ.get(PLUGIN_PATH_ENV, default))


def add_plugin_path() -> pathlib.Path:
  """Puts the plugin wheels on `sys.path`; must run before JAX is imported.

  Raises:
    RuntimeError: If JAX is already imported (its plugins are found when
      its backends start) or the folder lacks the CUDA plugin.
  """
  path = plugin_path()
  if not (path / 'jax_plugins').is_dir():
    raise RuntimeError(
      f'no CUDA plugin wheels in {path}: run `make aot-deps` (or set '
      f'{PLUGIN_PATH_ENV})'
    )
  if 'jax' in sys.modules and str(path) not in sys.path:
    raise RuntimeError('add_plugin_path() must run before jax is imported')
  if str(path) not in sys.path:
    sys.path.insert(0, str(path))
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  # Grace Adam's host handlers must be filed in the copy of the plugin
  # that compiles: registered in another copy (a CUDA plugin installed
  # elsewhere, which CI and `make test` name) they fill a registry no
  # compiler reads, and XLA:GPU aborts the process ("No FFI handler
  # registered ... on a platform Host").
  compiling = sorted((path / 'jax_plugins').glob('*/xla_cuda_plugin.so'))
  if compiling:
    os.environ[_REGISTER_IN_ENV] = str(compiling[-1])
  return path


def topology(gpu: str, num_devices: int = 1) -> Any:
  """A compile-only CUDA topology of `num_devices` GPUs of kind `gpu`."""
  import jax
  from jax.experimental import topologies

  from experiments.device import gpu_targets

  if jax.__version__ not in CHECKED_JAX:
    warnings.warn(
      f'deviceless compilation is checked on jax {CHECKED_JAX}, not '
      f'{jax.__version__}: its private API may have moved',
      stacklevel=2,
    )
  jax.config.update('jax_enable_compilation_cache', False)
  return topologies.get_topology_desc(
    platform='cuda',
    target_config=gpu_targets.target_config(gpu),
    topology=f'1x1x{num_devices}',
  )


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What a deviceless compile gives: the program and its memory."""

  hlo: str  # The optimized, scheduled HLO module.
  memory: dict[str, int]  # memory_analysis(): *_in_bytes fields.
  seconds: float  # Wall time of the compile (not of the step).


def _memory(executable: Any) -> dict[str, int]:
  stats = executable.get_compiled_memory_stats()
  return {
    name: int(getattr(stats, name))
    for name in dir(stats)
    if name.endswith('_in_bytes')
  }


def compile_for_gpu(
  fn: Callable[..., Any],
  args: tuple[Any, ...],
  gpu_topology: Any,
  jit_kwargs: dict[str, Any] | None = None,
) -> Compiled:
  """Compiles `jax.jit(fn, **jit_kwargs)` on `args` for `gpu_topology`.

  Args:
    fn: The function (or an already jitted one, when `jit_kwargs` is None).
    args: `jax.ShapeDtypeStruct`s (or arrays) sharded over CPU devices,
      memory kinds included.
    gpu_topology: From `topology()`, with as many devices as `args` span.
    jit_kwargs: Keyword arguments of `jax.jit`.

  Returns:
    The optimized HLO, `memory_analysis()` and the compile's wall time.
  """
  import jax
  from jax._src.interpreters import pxla

  jitted = jax.jit(fn, **jit_kwargs) if jit_kwargs is not None else fn
  start = time.perf_counter()
  lowered = jitted.trace(*args).lower(lowering_platforms=('cuda',))
  lowering = lowered._lowering
  lowering.compile_args['backend'] = gpu_topology.devices[0].client
  lowering._device_list = None
  captured = []
  original = pxla._cached_compilation

  def capture(*a: Any, **k: Any) -> Any:
    captured.append(original(*a, **k))
    return captured[-1]

  pxla._cached_compilation = capture
  try:
    lowering.compile(None, device_assignment=tuple(gpu_topology.devices))
  except AssertionError:
    # JAX's check that the executable's shardings are the CPU arguments'
    # fails by design here (CUDA devices against CPU ones); the executable
    # was built before it.
    if not captured:
      raise
  finally:
    pxla._cached_compilation = original
  executable = captured[-1]
  return Compiled(
    hlo=executable.hlo_modules()[0].to_string(),
    memory=_memory(executable),
    seconds=time.perf_counter() - start,
  )
