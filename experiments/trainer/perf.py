"""Throughput bookkeeping: model FLOPs, peak FLOP/s, MFU and memory use.

MFU (model FLOPs utilization) is the model's FLOPs per second divided by a
stated peak. The model FLOPs of one token, forward and backward, are
``6 * num_params`` for the matrix multiplies plus ``12 * layers * d_model *
seq_len`` for attention's score and value products (the PaLM paper's
estimate; it ignores the causal mask's saving). The peak, named wherever
MFU is shown, is ``--config.peak_tflops`` if set; else, for an accelerator,
its vendor's datasheet figure for the compute dtype (`DATASHEET_TFLOPS`);
else, on a CPU, the matmul peak recorded for this machine in
``results/cpu_peak.json`` (`experiments.trainer.cpu_peak`). Nothing is
timed at start-up.
"""

import math
import typing
from typing import Any

import jax

from experiments.trainer import cpu_peak

# Dense (no structured sparsity) peak TFLOP/s per chip from its vendor's
# datasheet: (16-bit, float32 or None, source). 16-bit is the BF16/FP16
# tensor-core figure; float32 is TF32's, which XLA uses for float32 matmuls
# at JAX's default precision on these GPUs (None: not stated for the chip).
# NVIDIA's datasheets print the sparse figures, twice the dense ones. The
# lowercased `device_kind` is matched by substring, in order.
DATASHEET_TFLOPS: tuple[tuple[str, float, float | None, str], ...] = (
  ('gh200', 989.0, 494.5, 'NVIDIA GH200 datasheet (H100/H200 SXM GPU)'),
  ('h200', 989.0, 494.5, 'NVIDIA H200 datasheet, SXM'),
  ('h100 pcie', 756.0, 378.0, 'NVIDIA H100 datasheet, PCIe'),
  ('h100', 989.0, 494.5, 'NVIDIA H100 datasheet, SXM'),
  ('h800', 989.0, 494.5, 'NVIDIA H800 datasheet, SXM'),
  ('b200', 2250.0, None, 'NVIDIA HGX B200 datasheet, per GPU'),
  ('a100', 312.0, 156.0, 'NVIDIA A100 datasheet'),
  ('a800', 312.0, 156.0, 'NVIDIA A800 datasheet'),
  ('l40s', 362.0, 183.0, 'NVIDIA L40S datasheet'),
  ('l4', 121.0, 60.0, 'NVIDIA L4 datasheet'),
  ('a10', 125.0, 62.5, 'NVIDIA A10 datasheet'),
  ('v100', 125.0, None, 'NVIDIA V100 datasheet, SXM2 (FP16)'),
  ('tpu v6 lite', 918.0, None, 'Google Cloud TPU v6e documentation'),
  ('tpu v6e', 918.0, None, 'Google Cloud TPU v6e documentation'),
  ('tpu v5 lite', 197.0, None, 'Google Cloud TPU v5e documentation'),
  ('tpu v5e', 197.0, None, 'Google Cloud TPU v5e documentation'),
  ('tpu v5p', 459.0, None, 'Google Cloud TPU v5p documentation'),
  ('tpu v5', 459.0, None, 'Google Cloud TPU v5p documentation'),
  ('tpu v4', 275.0, None, 'Google Cloud TPU v4 documentation'),
)


class Peak(typing.NamedTuple):
  """A peak FLOP/s and what it is (shown beside every MFU)."""

  # FLOP/s of all devices together; None when unknown.
  flops: float | None
  # Where the figure comes from, in words.
  source: str


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


def datasheet_peak(device_kind: str, dtype: str) -> tuple[float, str] | None:
  """A known accelerator's dense datasheet TFLOP/s for `dtype`, and source.

  Args:
    device_kind: `jax.Device.device_kind` ("NVIDIA H100 80GB HBM3", ...).
    dtype: The compute dtype ("bfloat16", "float16" or "float32").

  Returns:
    ``(tflops, source)``, or None for an unknown chip or dtype.
  """
  kind = device_kind.lower()
  for key, half, single, source in DATASHEET_TFLOPS:
    if key in kind:
      tflops = single if dtype == 'float32' else half
      if tflops is None:
        return None
      name = 'TF32' if dtype == 'float32' else dtype
      return tflops, f'{source}: {tflops:g} TFLOP/s dense {name}'
  return None


def peak_flops(
  devices: list[jax.Device],
  peak_tflops: float | None = None,
  dtype: str = 'bfloat16',
) -> Peak:
  """The stated peak FLOP/s of a set of devices working together.

  Args:
    devices: The devices of the mesh.
    peak_tflops: Per-device peak TFLOP/s from the config; None looks it
      up (the datasheet table, or this CPU's recorded peak).
    dtype: The compute dtype of the model.

  Returns:
    The peak and its source. CPU devices are one host's cores however many
    devices XLA shows, so a CPU peak is not multiplied by the device count.
  """
  on_cpu = devices[0].platform == 'cpu'
  count = 1 if on_cpu else len(devices)
  times = f' x {count} devices' if count > 1 else ''
  if peak_tflops is not None:
    return Peak(peak_tflops * 1e12 * count, f'--config.peak_tflops{times}')
  if on_cpu:
    tflops, source = cpu_peak.recorded_peak(dtype)
    return Peak(None if tflops is None else tflops * 1e12, source)
  found = datasheet_peak(devices[0].device_kind, dtype)
  if found is None:
    return Peak(
      None,
      f'no datasheet {dtype} figure for {devices[0].device_kind!r}: set '
      '--config.peak_tflops',
    )
  return Peak(found[0] * 1e12 * count, found[1] + times)


def mfu(
  tokens_per_s: float, flops_per_token: float, peak: float | None
) -> float:
  """Model FLOPs utilization, a fraction; NaN when the peak is unknown."""
  if not peak or not math.isfinite(tokens_per_s):
    return math.nan
  return tokens_per_s * flops_per_token / peak


HOST_MEMORY_KINDS = ('pinned_host', 'unpinned_host')


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
