"""The GPUs a deviceless compile can target, as XLA's GpuTargetConfigProto.

XLA:GPU compiles for a GPU it cannot see from a description of that GPU
(the `target_config` of `jax.experimental.topologies.get_topology_desc`):
compute capability, core counts, memory size and bandwidth. The figures are
NVIDIA's published ones for each part (those XLA's own H100 spec file,
`xla/backends/gpu/target_config/specs/`, records as a CUDA driver reports
them); `memory_bytes` is what the CUDA driver reports as total memory.
A GH200's GPU is an H100 die with 96 GB of HBM3 beside a 72-core Grace CPU
with 480 GB of LPDDR5X, joined by NVLink-C2C.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """One GPU as the compiler sees it, and the host beside it."""

  name: str  # The device name CUDA reports.
  memory_bytes: int  # HBM the driver reports.
  memory_bandwidth: int  # HBM bytes per second.
  memory_clock_khz: int
  budget_bytes: int  # Usable for a capacity search: the datasheet's GB.
  host_bytes: int  # Host memory of the machine this GPU usually sits in.
  host: str  # That machine, in words.


TARGETS = {
  'h100': GpuTarget(
    name='NVIDIA H100 80GB HBM3',
    memory_bytes=84_942_979_072,
    memory_bandwidth=3_352_320_000_000,
    memory_clock_khz=2_619_000,
    budget_bytes=80 * 10**9,
    host_bytes=2 * 1024**4,
    host='a DGX H100 (2 TiB of host memory for 8 GPUs)',
  ),
  'h200': GpuTarget(
    name='NVIDIA H200 141GB HBM3e',
    memory_bytes=151_397_597_184,
    memory_bandwidth=4_800_000_000_000,
    memory_clock_khz=3_750_000,
    budget_bytes=141 * 10**9,
    host_bytes=125 * 1024**3,
    host="the project's lent H200 machine (125 GiB of host memory)",
  ),
  'gh200': GpuTarget(
    name='NVIDIA GH200 480GB',
    memory_bytes=102_005_473_280,
    memory_bandwidth=4_000_000_000_000,
    memory_clock_khz=2_619_000,
    budget_bytes=96 * 10**9,
    host_bytes=480 * 10**9,
    host='the Grace CPU of the same superchip (480 GB of LPDDR5X)',
  ),
}

# Hopper (sm_90a): the same for every target above.
_HOPPER = {
  'core_count': 132,
  'fpus_per_core': 128,
  'clock_rate_ghz': 1.98,
  'l2_cache_size': 52_428_800,
  'shared_memory_per_block': 49_152,
  'shared_memory_per_block_optin': 232_448,
  'shared_memory_per_core': 233_472,
  'threads_per_block_limit': 1024,
  'threads_per_core_limit': 2048,
  'threads_per_warp': 32,
  'registers_per_core_limit': 65_536,
  'registers_per_block_limit': 65_536,
  'block_dim_limit_x': 2_147_483_647,
  'block_dim_limit_y': 65_535,
  'block_dim_limit_z': 65_535,
  'thread_dim_limit_x': 1024,
  'thread_dim_limit_y': 1024,
  'thread_dim_limit_z': 64,
  'device_address_bits': 64,
  'pcie_bandwidth': 32 * 2**30,
}


def _field(key: str, value: object) -> str:
  if isinstance(value, str):
    return f'  {key}: "{value}"'
  if isinstance(value, bool):
    return f'  {key}: {str(value).lower()}'
  return f'  {key}: {value}'


def target_config(gpu: str) -> str:
  """The GpuTargetConfigProto text for `gpu` ('h100', 'h200' or 'gh200')."""
  if gpu not in TARGETS:
    raise ValueError(f'unknown GPU {gpu!r}; one of {sorted(TARGETS)}')
  t = TARGETS[gpu]
  fields = {
    **_HOPPER,
    'memory_bandwidth': t.memory_bandwidth,
    'device_memory_size': t.memory_bytes,
    'ecc_enabled': True,
    'device_vendor': 'NVIDIA Corporation',
    'platform_version': 'Compute Capability 9.0a',
    'name': t.name,
    'model_str': (
      f'sm_9.0a with {t.memory_bytes}B RAM, 132 cores, 1980000KHz clock, '
      f'{t.memory_clock_khz}KHz mem clock, 52428800B L2$'
    ),
    'driver_version': '13.0.0',
    'runtime_version': '12.8.0',
    'compile_time_toolkit_version': '12.8.0',
    'dnn_version': '9.10.0',
  }
  lines = ['gpu_device_info {', *(_field(k, v) for k, v in fields.items())]
  lines += [
    '  cuda_compute_capability {',
    '    major: 9',
    '    feature_extension: ACCELERATED_FEATURES',
    '  }',
    '}',
    'platform_name: "CUDA"',
    'dnn_version_info { major: 9 minor: 10 patch: 0 }',
    f'device_description_str: "{t.name}"',
  ]
  return '\n'.join(lines) + '\n'
