"""Hardware profiles for the planner, and a host memory bandwidth probe.

A `HardwareProfile` holds the handful of rates and capacities the planner's
cost model needs. Units: memory in GB and bandwidths in GB/s, both in 1e9
bytes; compute in TFLOPS (1e12 FLOP/s). Every built-in number is a public
spec or a stated assumption:

* **Accelerator compute.** Dense bf16 peak from NVIDIA's data sheets (H100
  SXM in GH200: 989 TFLOPS; H100 PCIe: 756; H200 NVL (PCIe): 836). The
  planner multiplies it by `device_mfu`, the fraction of peak the forward and
  backward matmuls reach. We assume 0.6 for all GPUs: well-tuned bf16
  transformer steps on Hopper run at 55-65% of dense peak (attention, norms
  and the lower efficiency of the smaller GEMMs keep them under cuBLAS' ~75%
  on large square GEMMs). This is an assumption, not a fit to the paper.
* **Device casts** run at HBM bandwidth (a cast is a streaming read and
  write): GH200's H100 has 4.0 TB/s HBM3, H100 PCIe 2.0 TB/s HBM2e, H200 NVL
  4.8 TB/s HBM3e.
* **Host-device link**, per direction: NVLink-C2C 450 GB/s each way
  (900 GB/s total); PCIe Gen5 x16 is 32 GT/s x 16 lanes with 128b/130b
  coding = 63 GB/s each way (it is full duplex; "~64 GB/s" in the notes is
  the per-direction rate, 128 GB/s both ways together). `link_efficiency`
  0.8 is what pinned-memory DMA copies typically reach (bandwidthTest on a
  Gen5 x16 host reports ~50-55 GB/s), so PCIe Gen5 counts as ~50 GB/s each
  way. A Gen4 x16 link (the older ~25 GB/s-each-way figure) is
  `dataclasses.replace(H100_PCIE, link_gbs=31.5)`.
* **Host Adam** is memory bound: one fp32 AdamW step moves 28 bytes per
  parameter (30 with a fused bf16 copy of the new weights), so its time is
  `params * 28 B / (host_bandwidth_gbs * host_adam_efficiency)`. Grace's
  LPDDR5X is 500 GB/s (spec). SuperOffload's published GraceAdam step of
  8B parameters in 0.608 s moves 8e9 * 28 B / 0.608 s = 368 GB/s = 0.74 of
  the spec; we take `host_adam_efficiency` = 0.74 for Grace. Cross-check,
  independent of that figure: on x86 our own kernel reaches 0.83-0.97 of a
  same-traffic no-math loop (`results/bench_adam.json`), and such loops
  typically reach 80-90% of DRAM peak, i.e. 0.66-0.87 of spec, which
  brackets 0.74. The published 1B step (0.082 s) is then predicted at
  0.076 s (7% fast: fixed per-step costs the model ignores). PCIe hosts: one
  Sapphire Rapids socket, 8 channels of DDR5-4800 = 307 GB/s, 512 GB, and
  0.66 (= 0.8 STREAM/peak x 0.83 kernel/roofline) for Adam.
* **Host casts** (bf16 <-> fp32 as a separate pass, 6 bytes per element):
  `host_cast_gbs` bytes per second. The paper reports that the GPU casts
  about 100x faster than the CPU, i.e. a framework cast runs on about one
  core: 40 GB/s on Grace (= 4.0 TB/s / 100; one Neoverse V2 core streams
  roughly that), 20 GB/s on an x86 host (one core).
* **Capacity reserves.** `device_memory_reserve` / `host_memory_reserve`
  (10%) are kept back for the runtime, workspaces, fragmentation and the OS.

`measure_host_bandwidth()` measures this machine instead: it times
`jax_superoffload.kernels.stream_roofline` (Adam's 28 B/param traffic, no
math) and returns GB/s; `HardwareProfile.measured()` builds a profile on it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

# Bytes one fp32 AdamW step moves per parameter: reads param, grad, m, v and
# writes param, m, v.
ADAM_BYTES_PER_PARAM = 28
# With the fused bf16 copy of the new weights (2 more bytes written).
ADAM_LOWP_BYTES_PER_PARAM = 30
# Our kernel's speed relative to `stream_roofline` on x86 (0.83-0.97 in
# `results/bench_adam.json`); used for measured profiles.
MEASURED_ADAM_EFFICIENCY = 0.85
# A separate host cast pass relative to the roofline, measured profiles:
# the fused bf16 copy added ~1 ns/param at ~36 GB/s (bench_adam), i.e. a
# 12 B/param cast round trip at ~0.3 of the roofline rate.
MEASURED_CAST_EFFICIENCY = 0.3


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """One accelerator and its host, as the planner's cost model sees them."""

  # Human-readable name, shown by `Plan.__str__`.
  name: str
  # Accelerator memory, GB (1e9 bytes).
  device_memory_gb: float
  # Dense bf16 peak of the accelerator, TFLOPS.
  device_peak_tflops: float
  # Fraction of peak the forward/backward matmuls reach (assumption).
  device_mfu: float
  # Accelerator memory bandwidth, GB/s; device casts and device Adam use it.
  device_bandwidth_gbs: float
  # Host<->device link, GB/s in each direction (spec; full duplex).
  link_gbs: float
  # Fraction of `link_gbs` that DMA copies reach.
  link_efficiency: float
  # Host (CPU) memory, GB.
  host_memory_gb: float
  # Host memory bandwidth, GB/s (spec, or measured by the roofline loop).
  host_bandwidth_gbs: float
  # Fraction of `host_bandwidth_gbs` the host Adam kernel sustains.
  host_adam_efficiency: float
  # Throughput of a separate host bf16<->fp32 cast, GB/s of traffic.
  host_cast_gbs: float
  # Fraction of accelerator memory kept back (runtime, fragmentation).
  device_memory_reserve: float = 0.1
  # Fraction of host memory kept back (OS, pinned-buffer overheads).
  host_memory_reserve: float = 0.1
  # Host and "device" are one memory (CPU backend): capacities are shared
  # and moving weights out of the device frees nothing.
  unified_memory: bool = False
  # Billions of parameters a second the host step with 8-bit moments can
  # compute (its arithmetic alone: measured with its data in cache). Its
  # codec costs about as much as the step, so with few cores it is compute-
  # rather than memory-bound. 0: not measured; the step is then taken as
  # memory-bound, as for fp32 and bf16 moments.
  host_q8_gparams_s: float = 0.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type == 'float' and not value > 0:
        optional = field.name.endswith('_reserve') or field.name.endswith('_s')
        if optional and value == 0:
          continue
        raise ValueError(f'{field.name} must be positive, got {value!r}')
    for name in ('device_mfu', 'link_efficiency', 'host_adam_efficiency'):
      if getattr(self, name) > 1:
        raise ValueError(f'{name} must be <= 1, got {getattr(self, name)}')
    for name in ('device_memory_reserve', 'host_memory_reserve'):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f'{name} must be in [0, 1), got {getattr(self, name)}')

  @property
  def usable_device_bytes(self) -> float:
    """Accelerator bytes the planner may fill."""
    return self.device_memory_gb * 1e9 * (1 - self.device_memory_reserve)

  @property
  def usable_host_bytes(self) -> float:
    """Host bytes the planner may fill."""
    return self.host_memory_gb * 1e9 * (1 - self.host_memory_reserve)

  @property
  def link_bytes_per_s(self) -> float:
    """Effective bytes per second of the link, in each direction."""
    return self.link_gbs * 1e9 * self.link_efficiency

  @property
  def host_adam_bytes_per_s(self) -> float:
    """Bytes per second a host Adam step moves."""
    return self.host_bandwidth_gbs * 1e9 * self.host_adam_efficiency

  def host_adam_seconds_per_param(
    self, bytes_per_param: float, moments: str = 'fp32'
  ) -> float:
    """Seconds a host Adam step takes per parameter moving these bytes.

    Memory-bound, except for 8-bit moments where `host_q8_gparams_s` says
    the arithmetic is slower than the traffic.
    """
    memory = bytes_per_param / self.host_adam_bytes_per_s
    if moments == '8bit' and self.host_q8_gparams_s:
      return max(memory, 1 / (self.host_q8_gparams_s * 1e9))
    return memory

  @property
  def device_flops_per_s(self) -> float:
    """FLOP/s the forward and backward passes achieve."""
    return self.device_peak_tflops * 1e12 * self.device_mfu

  @classmethod
  def measured(
    cls,
    base: HardwareProfile | None = None,
    *,
    n_params: int = 16 * 2**20,
    repeats: int = 5,
  ) -> HardwareProfile:
    """`base` (default `CPU_ONLY`) with this machine's host bandwidth.

    Runs `measure_host_bandwidth` and sets `host_bandwidth_gbs` to it,
    `host_adam_efficiency` to `MEASURED_ADAM_EFFICIENCY` and `host_cast_gbs`
    to `MEASURED_CAST_EFFICIENCY` of it, and `host_q8_gparams_s` by
    `measure_q8_step_rate`. With unified memory (the CPU
    backend) the "device" is the same memory, so its bandwidth is set too and
    a transfer is a copy (read + write) at half of it.

    Args:
      base: The profile whose other fields are kept.
      n_params: Parameters per timed roofline step.
      repeats: Timed steps; the median is used.

    Returns:
      A new `HardwareProfile`.
    """
    base = CPU_ONLY if base is None else base
    gbs = measure_host_bandwidth(n_params, repeats=repeats)
    changes = dict(
      name=f'{base.name} (measured host {gbs:.1f} GB/s)',
      host_bandwidth_gbs=gbs,
      host_adam_efficiency=MEASURED_ADAM_EFFICIENCY,
      host_cast_gbs=MEASURED_CAST_EFFICIENCY * gbs,
      host_q8_gparams_s=measure_q8_step_rate(repeats=repeats),
    )
    if base.unified_memory:
      changes.update(device_bandwidth_gbs=gbs, link_gbs=gbs / 2)
    return dataclasses.replace(base, **changes)


def measure_host_bandwidth(
  n_params: int = 16 * 2**20, *, repeats: int = 5, warmup: int = 1
) -> float:
  """Measures host memory bandwidth as an Adam step's traffic sees it.

  Times `jax_superoffload.kernels.stream_roofline` (reads param, grad, m, v
  and writes param, m, v, with no Adam math, on the kernel's threads) on the
  CPU backend, in place, and counts 28 bytes per parameter.

  Args:
    n_params: Parameters per step (four fp32 arrays of this size).
    repeats: Timed steps; the median is returned.
    warmup: Untimed steps first (compilation, page faults).

  Returns:
    Bandwidth in GB/s (1e9 bytes per second).
  """
  # The FFI extension, lazily: planning needs it only to measure.
  from jax_superoffload._src.host import grace_adam

  if n_params < 1 or repeats < 1:
    raise ValueError(
      f'n_params ({n_params}) and repeats ({repeats}) must be >= 1'
    )
  cpu = jax.devices('cpu')[0]
  state = [
    jax.device_put(jnp.full((n_params,), v, jnp.float32), cpu)
    for v in (1.0, 1e-3, 0.0, 1.0)
  ]
  step = jax.jit(grace_adam.stream_roofline, donate_argnums=(0, 2, 3))
  times = []
  for i in range(warmup + repeats):
    start = time.perf_counter()
    master, mu, nu = step(*state)
    jax.block_until_ready((master, mu, nu))
    if i >= warmup:
      times.append(time.perf_counter() - start)
    state = [master, state[1], nu, mu]
  seconds = statistics.median(times)
  return n_params * ADAM_BYTES_PER_PARAM / seconds / 1e9


GH200 = HardwareProfile(
  name='GH200 (H100 96 GB + Grace, NVLink-C2C)',
  device_memory_gb=96.0,
  device_peak_tflops=989.0,
  device_mfu=0.6,
  device_bandwidth_gbs=4000.0,
  link_gbs=450.0,
  link_efficiency=0.8,
  host_memory_gb=480.0,
  host_bandwidth_gbs=500.0,
  host_adam_efficiency=0.74,
  host_cast_gbs=40.0,
)
"""One GH200 Superchip: 96 GB HBM3, 72-core Grace with 480 GB LPDDR5X."""

H100_PCIE = HardwareProfile(
  name='H100 PCIe 80 GB (PCIe Gen5 x16, x86 host)',
  device_memory_gb=80.0,
  device_peak_tflops=756.0,
  device_mfu=0.6,
  device_bandwidth_gbs=2000.0,
  link_gbs=63.0,
  link_efficiency=0.8,
  host_memory_gb=512.0,
  host_bandwidth_gbs=307.0,
  host_adam_efficiency=0.66,
  host_cast_gbs=20.0,
)
"""An H100 PCIe card in a one-socket DDR5 x86 server."""

# The same server and link as H100_PCIE; only the card differs.
H200_PCIE = dataclasses.replace(
  H100_PCIE,
  name='H200 NVL 141 GB (PCIe Gen5 x16, x86 host)',
  device_memory_gb=141.0,
  device_peak_tflops=836.0,
  device_bandwidth_gbs=4800.0,
)
"""An H200 NVL (PCIe) card in a one-socket DDR5 x86 server."""

CPU_ONLY = HardwareProfile(
  name='CPU only (2 cores, host = device)',
  device_memory_gb=16.0,
  # 2 cores x 2 FMA units x 8 fp32 lanes x 2 FLOP x ~2.5 GHz.
  device_peak_tflops=0.16,
  device_mfu=0.3,
  device_bandwidth_gbs=45.0,
  # A "transfer" is a memcpy in one memory: read + write, half the rate.
  link_gbs=22.5,
  link_efficiency=1.0,
  host_memory_gb=16.0,
  # The notes' 1600-2000 Mparam/s roofline x 28 B; `measured()` replaces it.
  host_bandwidth_gbs=45.0,
  host_adam_efficiency=MEASURED_ADAM_EFFICIENCY,
  host_cast_gbs=MEASURED_CAST_EFFICIENCY * 45.0,
  unified_memory=True,
)
"""This kind of machine: the CPU backend, where host and device are one."""


def measure_q8_step_rate(
  n_params: int = 2**20, *, repeats: int = 5, warmup: int = 1
) -> float:
  """The host step's rate with 8-bit moments, from cache: Gparam/s.

  Steps `n_params` parameters (about 10 bytes each: small enough to stay in
  cache, and several of the kernel's 2^18-element work chunks, so that
  every core works) with 8-bit moments through the kernel, in place, 20
  times a timed step; the median over `repeats`. Its arithmetic alone, for
  the planner's `host_q8_gparams_s`.
  """
  from jax_superoffload._src.core.hyperparams import Hyperparams
  from jax_superoffload._src.host import (
    grace_adam,  # The FFI extension, lazily.
  )

  if n_params < 1 or repeats < 1:
    raise ValueError(
      f'n_params ({n_params}) and repeats ({repeats}) must be >= 1'
    )
  cpu = jax.devices('cpu')[0]
  blocks = -(-n_params // 256)
  state = [
    jax.device_put(jnp.ones((n_params,), jnp.float32), cpu),
    jax.device_put(jnp.zeros((n_params,), jnp.uint8), cpu),
    jax.device_put(jnp.zeros((n_params,), jnp.uint8), cpu),
    jax.device_put(jnp.zeros((blocks,), jnp.float32), cpu),
    jax.device_put(jnp.zeros((blocks,), jnp.float32), cpu),
  ]
  grad = jax.device_put(jnp.full((n_params,), 1e-3, jnp.float32), cpu)
  inner = 20

  def steps(state, grad):
    def body(i, state):
      m, a, v, sa, sv = state
      out = grace_adam.adam_step_lowp_segments(
        [m], [a], [v], ([sa], [sv]), [grad], None,
        Hyperparams(count=i, learning_rate=1e-3),
      )  # fmt: skip
      return (out[0][0], out[1][0], out[2][0], out[3][0][0], out[3][1][0])

    return jax.lax.fori_loop(0, inner, body, tuple(state))

  step = jax.jit(steps, donate_argnums=(0,))
  times = []
  for i in range(warmup + repeats):
    start = time.perf_counter()
    state = step(state, grad)
    jax.block_until_ready(state)
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return n_params * inner / statistics.median(times) / 1e9
