"""jax_superoffload: SuperOffload for JAX and Optax.

Optax transformations whose Adam state lives in host memory and whose step
runs on the CPU (the Grace Adam kernel, through XLA FFI), and the pieces a
large-model training run needs around them.
"""

import importlib

from jax_superoffload import kernels
from jax_superoffload import ulysses
from jax_superoffload._src.core.backend import compiling_for
from jax_superoffload._src.host.executors import resolve as resolve_executor
from jax_superoffload._src.host.plugin_ffi import host_registration
from jax_superoffload._src.optim.alias import adam
from jax_superoffload._src.optim.alias import adamw
from jax_superoffload._src.optim.interchange import export_adam_state
from jax_superoffload._src.optim.interchange import import_adam_state
from jax_superoffload._src.optim.legacy import from_legacy_layout
from jax_superoffload._src.optim.legacy import legacy_layout
from jax_superoffload._src.optim.offload import Offload
from jax_superoffload._src.optim.scan_overlap import overlap_scan
from jax_superoffload._src.optim.shardings import state_shardings
from jax_superoffload._src.optim.state import OffloadState
from jax_superoffload._src.optim.state import SuperOffloadState
from jax_superoffload._src.parallel.weight_flow import WEIGHT_POLICIES
from jax_superoffload._src.parallel.weight_flow import fetch_stacked
from jax_superoffload._src.parallel.weight_flow import match_placement
from jax_superoffload._src.parallel.weight_flow import memory_spaces
from jax_superoffload._src.parallel.weight_flow import offload_stacked
from jax_superoffload._src.parallel.weight_flow import update_offloaded
from jax_superoffload._src.parallel.weight_flow import weight_flow_scan
from jax_superoffload._src.parallel.zero import replicated_state_bytes
from jax_superoffload._src.planning.hardware import ADAM_BYTES_PER_PARAM
from jax_superoffload._src.planning.hardware import CPU_ONLY
from jax_superoffload._src.planning.hardware import GH200
from jax_superoffload._src.planning.hardware import H100_PCIE
from jax_superoffload._src.planning.hardware import H200_PCIE
from jax_superoffload._src.planning.hardware import HardwareProfile
from jax_superoffload._src.planning.hardware import measure_host_bandwidth

__version__ = '0.1.0'

# The planner is imported on first use: building and stepping an optimizer
# never plans unless an "auto" choice asks (then in `init`, once per tree).
_PLANNER = 'jax_superoffload._src.planning.planner'
_LAZY = {
  'Estimate': _PLANNER,
  'ModelSpec': _PLANNER,
  'Plan': _PLANNER,
  'plan': _PLANNER,
}


def __getattr__(name: str):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))


__all__ = [
  'ADAM_BYTES_PER_PARAM',
  'CPU_ONLY',
  'GH200',
  'H100_PCIE',
  'H200_PCIE',
  'WEIGHT_POLICIES',
  'Estimate',
  'HardwareProfile',
  'ModelSpec',
  'Offload',
  'OffloadState',
  'Plan',
  'SuperOffloadState',
  'adam',
  'adamw',
  'compiling_for',
  'export_adam_state',
  'fetch_stacked',
  'from_legacy_layout',
  'host_registration',
  'import_adam_state',
  'kernels',
  'legacy_layout',
  'match_placement',
  'measure_host_bandwidth',
  'memory_spaces',
  'offload_stacked',
  'overlap_scan',
  'plan',
  'replicated_state_bytes',
  'resolve_executor',
  'state_shardings',
  'ulysses',
  'update_offloaded',
  'weight_flow_scan',
]
