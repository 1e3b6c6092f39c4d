"""Throughput bookkeeping: model FLOPs, peak FLOP/s, MFU and memory use.

MFU (model FLOPs utilization) is the model's FLOPs per second divided by the
hardware's peak. The model FLOPs of one token, forward and backward, are
``6 * num_params`` for the matrix multiplies plus ``12 * layers * d_model *
seq_len`` for attention's score and value products (the PaLM paper's
estimate; it ignores the causal mask's saving). The peak comes from the
config, from a small table of accelerators keyed by `jax.Device.device_kind`,
or, on the CPU backend, from a float32 matmul timed once at startup.
"""

import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp

# Dense bf16 peak TFLOP/s per chip, matched by substring of the lowercased
# `device_kind`; the first match wins, so specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
  ('gh200', 989.0),
  ('h200', 989.0),
  ('h100 pcie', 756.0),
  ('h100', 989.0),
  ('h800', 989.0),
  ('b200', 2250.0),
  ('a100', 312.0),
  ('a800', 312.0),
  ('l40s', 362.0),
  ('l4', 121.0),
  ('a10', 125.0),
  ('v100', 125.0),
  ('tpu v6 lite', 918.0),
  ('tpu v6e', 918.0),
  ('tpu v5 lite', 197.0),
  ('tpu v5e', 197.0),
  ('tpu v5p', 459.0),
  ('tpu v5', 459.0),
  ('tpu v4', 275.0),
)

HOST_MEMORY_KINDS = ('pinned_host', 'unpinned_host')


def flops_per_token(
  num_params: int, num_layers: int, d_model: int, seq_len: int
) -> float:
  """Training FLOPs (forward and backward) per token.

  Args:
    num_params: All parameters, embeddings included (a tied embedding is
      also the output head's matrix multiply).
    num_layers: Transformer blocks.
    d_model: Model width (heads times head width).
    seq_len: Context length.

  Returns:
    ``6 * num_params + 12 * num_layers * d_model * seq_len``.
  """
  return 6.0 * num_params + 12.0 * num_layers * d_model * seq_len


def table_peak_tflops(device_kind: str) -> float | None:
  """Looks up the dense bf16 peak of a known accelerator, or None."""
  kind = device_kind.lower()
  for key, tflops in PEAK_TFLOPS:
    if key in kind:
      return tflops
  return None


@functools.cache
def measure_cpu_peak_tflops(seconds: float = 1.0, n: int = 512) -> float:
  """Times a float32 ``n x n`` matmul on the first CPU device.

  Cached: the first call of a process takes about `seconds` (plus a small
  compilation); later calls return the same number.

  Args:
    seconds: Time budget of the measurement.
    n: Matrix size.

  Returns:
    The best observed rate over batches of calls, in TFLOP/s.
  """
  device = jax.devices('cpu')[0]
  a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, a).block_until_ready()  # Compile.
  calls, best = 4, math.inf
  deadline = time.perf_counter() + seconds
  while time.perf_counter() < deadline:
    t0 = time.perf_counter()
    for _ in range(calls):
      out = matmul(a, a)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - t0) / calls)
  return 2.0 * n**3 / best / 1e12


def peak_flops(
  devices: list[jax.Device], peak_tflops: float | None = None
) -> tuple[float | None, str]:
  """Peak FLOP/s of a set of devices working together.

  Args:
    devices: The devices of the mesh.
    peak_tflops: Per-device peak TFLOP/s; None looks it up (accelerators)
      or measures it (CPU).

  Returns:
    ``(flops, source)``: the peak in FLOP/s (None when unknown) and where
    it came from (``"config"``, ``"table"``, ``"measured"`` or
    ``"unknown"``). CPU devices are one host's cores however many devices
    XLA shows, so a CPU peak is not multiplied by the device count.
  """
  on_cpu = devices[0].platform == 'cpu'
  count = 1 if on_cpu else len(devices)
  if peak_tflops is not None:
    return peak_tflops * 1e12 * count, 'config'
  if on_cpu:
    return measure_cpu_peak_tflops() * 1e12, 'measured'
  tflops = table_peak_tflops(devices[0].device_kind)
  if tflops is None:
    return None, 'unknown'
  return tflops * 1e12 * count, 'table'


def mfu(
  tokens_per_s: float, flops_per_token: float, peak: float | None
) -> float:
  """Model FLOPs utilization, a fraction; NaN when the peak is unknown."""
  if not peak or not math.isfinite(tokens_per_s):
    return math.nan
  return tokens_per_s * flops_per_token / peak


def bytes_by_memory_kind(tree: Any, device: jax.Device) -> dict[str, int]:
  """Bytes that `device` holds of each array in `tree`, by memory kind.

  Each array counts its addressable shards on `device`, so an array sharded
  N ways counts 1/N of its size and a replicated one counts it whole.

  Args:
    tree: A pytree of `jax.Array`s (other leaves are skipped).
    device: The device whose shards are counted.

  Returns:
    ``{"host": bytes, "device": bytes}``; host is ``pinned_host`` or
    ``unpinned_host`` memory, device everything else.
  """
  totals = {'host': 0, 'device': 0}
  for x in jax.tree.leaves(tree):
    if not isinstance(x, jax.Array):
      continue
    kind = getattr(x.sharding, 'memory_kind', None)
    where = 'host' if kind in HOST_MEMORY_KINDS else 'device'
    for shard in x.addressable_shards:
      if shard.device == device:
        totals[where] += int(shard.data.nbytes)
  return totals
