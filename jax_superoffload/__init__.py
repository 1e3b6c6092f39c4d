"""jax_superoffload: SuperOffload for JAX and Optax.

Optax transformations whose Adam state lives in host memory and whose step
runs on the CPU (the Grace Adam kernel, through XLA FFI), and the pieces a
large-model training run needs around them.
"""

from jax_superoffload import kernels
from jax_superoffload import ulysses
from jax_superoffload._src.adam import adam
from jax_superoffload._src.adam import adamw
from jax_superoffload._src.hardware import CPU_ONLY
from jax_superoffload._src.hardware import GH200
from jax_superoffload._src.hardware import H100_PCIE
from jax_superoffload._src.hardware import H200_PCIE
from jax_superoffload._src.hardware import HardwareProfile
from jax_superoffload._src.hardware import measure_host_bandwidth
from jax_superoffload._src.interchange import export_adam_state
from jax_superoffload._src.interchange import import_adam_state
from jax_superoffload._src.planner import Estimate
from jax_superoffload._src.planner import ModelSpec
from jax_superoffload._src.planner import Plan
from jax_superoffload._src.planner import plan
from jax_superoffload._src.transform import SuperOffloadState
from jax_superoffload._src.weight_flow import WEIGHT_POLICIES
from jax_superoffload._src.weight_flow import fetch_stacked
from jax_superoffload._src.weight_flow import match_placement
from jax_superoffload._src.weight_flow import memory_spaces
from jax_superoffload._src.weight_flow import offload_stacked
from jax_superoffload._src.weight_flow import update_offloaded
from jax_superoffload._src.weight_flow import weight_flow_scan
from jax_superoffload._src.zero import replicated_state_bytes

__version__ = '0.1.0'

__all__ = [
  'CPU_ONLY',
  'GH200',
  'H100_PCIE',
  'H200_PCIE',
  'WEIGHT_POLICIES',
  'Estimate',
  'HardwareProfile',
  'ModelSpec',
  'Plan',
  'SuperOffloadState',
  'adam',
  'adamw',
  'export_adam_state',
  'fetch_stacked',
  'import_adam_state',
  'kernels',
  'match_placement',
  'measure_host_bandwidth',
  'memory_spaces',
  'offload_stacked',
  'plan',
  'replicated_state_bytes',
  'ulysses',
  'update_offloaded',
  'weight_flow_scan',
]

# Public for experiments/ (issue 27)
# - `resolve_executor`: the executor an `executor=` string runs on this
#   backend ("auto" resolved), for the trainer's logs and the GPU benchmark.
# - `host_registration`: whether the kernel is filed as host compute in the
#   CUDA PJRT plugin's FFI registry, and why not; reported by the GPU check.
# - `adam_step_segments`, `adam_step_lowp_segments`, `adam_step_speculative`
#   with `Hyperparams` and `MOMENT_BLOCK`: the kernel's bucket entry points
#   that the optimizer's host step calls, which `kernels.adam_step` does not
#   cover; benchmarked one by one by experiments/benchmarks/bench_adam.
# - `ADAM_BYTES_PER_PARAM`: the bytes one fp32 AdamW step moves per
#   parameter, the unit of `HardwareProfile.host_adam_bytes_per_s`.
from jax_superoffload._src.executors import resolve as resolve_executor
from jax_superoffload._src.grace_adam import adam_step_lowp_segments
from jax_superoffload._src.grace_adam import adam_step_segments
from jax_superoffload._src.grace_adam import adam_step_speculative
from jax_superoffload._src.hardware import ADAM_BYTES_PER_PARAM
from jax_superoffload._src.hyperparams import Hyperparams
from jax_superoffload._src.moments import BLOCK as MOMENT_BLOCK
from jax_superoffload._src.plugin_ffi import host_registration

__all__ += [
  'ADAM_BYTES_PER_PARAM',
  'MOMENT_BLOCK',
  'Hyperparams',
  'adam_step_lowp_segments',
  'adam_step_segments',
  'adam_step_speculative',
  'host_registration',
  'resolve_executor',
]
