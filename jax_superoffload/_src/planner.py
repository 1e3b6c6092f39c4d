"""`plan`: SuperOffload's policies and a predicted step time for one model.

A cost model, not a measurement. It picks the three SuperOffload policies
for a model on a `HardwareProfile` and predicts the step time they give,
next to device-resident Adam and a ZeRO-Offload-style baseline.

Model (N parameters, T = seq_len x batch tokens per step):

* **Compute.** Forward 2NT, backward 4NT FLOPs, plus a 2NT recomputed
  forward with activation checkpointing, at `peak x device_mfu`. Attention
  score FLOPs are not counted (about s / 6h of 6NT, e.g. 13% at s = 4096,
  h = 5120). Gradients arrive uniformly in parameters over the backward
  pass, last for the first layers and the embeddings.
* **Activations** (Korthikanti et al. 2022, bytes, with flash attention
  dropping their 5as/h score term): 34 sbh x (bytes_per_activation / 2) per
  layer; with checkpointing only each layer's input (sbh x bytes) is kept,
  plus one layer's full set during its recomputation. Plus fp32 logits,
  4 sbV (their gradient overwrites them).
* **Memory per parameter.** Device-resident Adam: 16 B (bf16 weight and
  gradient, fp32 master, m, v) on the device. Offloaded (both systems):
  bf16 weights and gradients on the device (4 B; a jitted step holds the
  whole gradient tree), fp32 master, m, v and gradient on the host (16 B;
  the gradient is kept so that a failed speculation can be redone), plus
  one bucket in flight each way (fp32, or bf16 when casting on the host).
  Weight-flow keeps two layers' bf16 weights and gradients on the device
  and a bf16 (host cast) copy of the weights on the host (+2 B). A bucket
  kept on the device adds its fp32 master, m and v there (12 B; with
  weight-flow also its resident bf16 weights and gradients) and leaves the
  host.
* **Transfers.** Gradients go device-to-host, new weights host-to-device,
  fp32 (4 B) when casting on the device, bf16 (2 B) when casting on the
  host; the link is full duplex. Weight-flow streams the weights in twice a
  step (forward; backward with its recomputation), in the dtype that
  crosses the link (fp32 when casting on the device, cast again each pass),
  overlapped with compute layer by layer: a pass takes max(compute, stream).
* **Casts.** Device: grads up, weights down, 6 B per element per cast at HBM
  bandwidth. Host: the same 12 B per parameter at `host_cast_gbs`.
* **Host Adam** streams 28 B per parameter at `host_bandwidth_gbs x
  host_adam_efficiency`. With speculation (STV) each bucket's Adam starts
  when its gradients reach the host; the buckets go through a three-stage
  pipeline (device-to-host copy, host cast + Adam, host-to-device copy), one
  bucket at a time per stage, which is what overlaps them with backward.
  The step ends when the device is done and the last bucket is back.
* **ZeRO-Offload-style baseline**: weight-stationary, bf16 over the link,
  cast on the host, every bucket on the CPU, no STV and no overlap: compute,
  then copies, casts, Adam and copies, one after another.

Decision rules:

* **Weights**: weight-stationary while bf16 weights + gradients +
  activations + in-flight buckets fit in usable device memory, weight-flow
  beyond (always stationary with unified memory: moving frees nothing).
* **Cast side**: per parameter and step, `device` costs
  (4 + 4w) B / link + (6 + 6w) B / HBM bandwidth and `host` costs
  (2 + 2w) B / link + 12 B / host cast rate, with w = 1 weight transfer
  (stationary) or 2 (flow); the cheaper wins (ties go to the device).
* **Bucket size**: N / 32, clamped to the reference implementation's 1e8 to
  8e8 elements, and at most N / 8 so that small models still get 8
  buckets: the exposed tail (one bucket) stays near 3% of the host work
  while per-bucket overheads stay negligible.
* **Device buckets** (`'auto'`): the fewest last-arriving buckets (at least
  one) that, kept on the device with their Adam there, bring the predicted
  step within 0.1% of the best over all counts up to 20% of the buckets
  (the reference's 0.8 CPU ratio) that fit in device memory. Those are the
  buckets whose host work would otherwise be exposed after backward.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import jax
import numpy as np

from jax_superoffload._src.hardware import (
  ADAM_BYTES_PER_PARAM,
  ADAM_LOWP_BYTES_PER_PARAM,
  GH200,
  HardwareProfile,
)

# Bytes a host cast pass moves per parameter: grads bf16 -> fp32 (2 read +
# 4 written) and weights fp32 -> bf16 (4 read + 2 written).
CAST_BYTES_PER_PARAM = 12
# Device-resident mixed-precision Adam: bf16 weight and gradient, fp32
# master, m and v.
DEVICE_ADAM_BYTES_PER_PARAM = 16
# Offloaded: bf16 weight and gradient on the device.
OFFLOAD_DEVICE_BYTES_PER_PARAM = 4
# Offloaded: fp32 master, m, v and gradient on the host.
OFFLOAD_HOST_BYTES_PER_PARAM = 16
# fp32 master, m and v of a bucket whose Adam runs on the device.
DEVICE_BUCKET_STATE_BYTES_PER_PARAM = 12
# Reference bucket sizes (elements) and the auto rule's targets.
MIN_BUCKET_ELEMENTS = 100_000_000
MAX_BUCKET_ELEMENTS = 800_000_000
TARGET_BUCKETS = 32
MIN_BUCKETS = 8
# At most this fraction of the buckets keeps its Adam on the device.
MAX_DEVICE_BUCKET_FRACTION = 0.2
# Device-bucket counts within this factor of the best time count as best.
DEVICE_BUCKET_TOLERANCE = 1e-3
# Weight-flow keeps this many layers of weights and gradients on the device.
FLOW_WINDOW_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A decoder-only transformer as the cost model sees it."""

  # Parameter count.
  params: int
  # Transformer blocks.
  layers: int
  # Width of the residual stream.
  hidden: int
  # Tokens per sequence.
  seq_len: int = 2048
  # Sequences per step on this accelerator.
  batch: int = 8
  # Attention heads (only used without flash attention); None: hidden / 128.
  heads: int | None = None
  # Vocabulary size (logits memory).
  vocab: int = 32000
  # Bytes per stored activation (2 for bf16).
  bytes_per_activation: int = 2
  # Keep only layer inputs and recompute the rest in backward.
  activation_checkpointing: bool = True
  # Attention scores are not stored (flash attention).
  flash_attention: bool = True

  def __post_init__(self):
    for name in ('params', 'layers', 'hidden', 'seq_len', 'batch', 'vocab'):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f'{name} must be a positive integer, got {value!r}')

  @classmethod
  def from_params(cls, params: float, **kwargs: Any) -> ModelSpec:
    """A GPT-shaped model of about `params` parameters.

    Uses layers = hidden / 128 (GPT-3's 6.7B and 13B shapes) and
    params = 12 layers hidden^2 + vocab hidden, with hidden a multiple of
    128; `params` itself is kept exactly.

    Args:
      params: Parameter count.
      **kwargs: Other `ModelSpec` fields (seq_len, batch, vocab, ...).

    Returns:
      A `ModelSpec`.
    """
    vocab = kwargs.get('vocab', cls.vocab)
    lo, hi = 1.0, 1e6
    for _ in range(100):  # Bisection on the increasing 12h^3/128 + Vh.
      mid = (lo + hi) / 2
      if 12 * mid**3 / 128 + vocab * mid < params:
        lo = mid
      else:
        hi = mid
    hidden = max(128, 128 * round(lo / 128))
    layers = max(1, round((params - vocab * hidden) / (12 * hidden**2)))
    return cls(params=int(params), layers=layers, hidden=hidden, **kwargs)

  @property
  def tokens(self) -> int:
    """Tokens per step."""
    return self.seq_len * self.batch


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A reference system's predicted step on the same model and hardware."""

  # Predicted seconds per step.
  step_time_s: float
  # Whether its device and host bytes fit in the usable memories.
  fits: bool
  # Accelerator bytes it needs.
  device_bytes: float
  # Host bytes it needs.
  host_bytes: float
  # Tokens per second.
  tokens_per_s: float
  # Model TFLOPS (6NT per step, recomputation not counted).
  tflops: float
  # Fraction of the step the accelerator is busy.
  device_busy_fraction: float


@dataclasses.dataclass(frozen=True)
class Plan:
  """SuperOffload's policies for one model and its predicted step.

  The time parts add up as `step_time_s = compute_s + device_cast_s +
  device_adam_s + d2h_s + h2d_s + host_cast_s + host_adam_s - overlap_s`.
  """

  # The model planned for.
  model: ModelSpec
  # The hardware planned for.
  hardware: HardwareProfile
  # 'stationary' (bf16 weights stay on the device) or 'flow' (streamed).
  weights: str
  # 'device' (move fp32, cast on the accelerator) or 'host'.
  cast: str
  # Elements per bucket.
  bucket_elements: int
  # fp32 bytes per bucket, for `adam(..., bucket_bytes=...)`.
  bucket_bytes: int
  # Buckets in all.
  bucket_count: int
  # Last-arriving buckets whose Adam runs on the device.
  device_buckets: int
  # device_buckets / bucket_count.
  device_bucket_fraction: float
  # Parameters in device buckets.
  device_params: int
  # Whether device_bytes and host_bytes fit in the usable memories.
  fits: bool
  # Accelerator bytes needed.
  device_bytes: float
  # Host bytes needed.
  host_bytes: float
  # Of device_bytes, activations.
  activation_bytes: float
  # Forward, backward and recomputation on the accelerator.
  compute_s: float
  # Casts on the accelerator.
  device_cast_s: float
  # Adam of the device buckets, on the accelerator.
  device_adam_s: float
  # Device-to-host copies (gradients).
  d2h_s: float
  # Host-to-device copies (new weights, or weight-flow streams).
  h2d_s: float
  # Casts on the host.
  host_cast_s: float
  # Adam of the host buckets, on the host.
  host_adam_s: float
  # Copy, cast and host Adam time hidden under accelerator work.
  overlap_s: float
  # Predicted seconds per step.
  step_time_s: float
  # Tokens per second.
  tokens_per_s: float
  # Model TFLOPS (6NT per step, recomputation not counted).
  tflops: float
  # Fraction of the step the accelerator is busy.
  device_busy_fraction: float
  # Everything on the accelerator, for reference.
  device_adam: Estimate
  # ZeRO-Offload-style offload, for reference.
  zero_offload: Estimate

  def __str__(self) -> str:
    gb, ms = 1e-9, 1e3
    m, hw = self.model, self.hardware
    lines = [
      f'SuperOffload plan (model prediction) for {m.params / 1e9:.2f}B params'
      f' ({m.layers} layers x {m.hidden}, seq {m.seq_len} x batch'
      f' {m.batch}) on {hw.name}',
      f'  weights: {self.weights}, cast on: {self.cast}, fits:'
      f' {self.fits} (device {self.device_bytes * gb:.1f} of'
      f' {hw.usable_device_bytes * gb:.1f} GB usable, activations'
      f' {self.activation_bytes * gb:.1f} GB; host'
      f' {self.host_bytes * gb:.1f} of {hw.usable_host_bytes * gb:.1f} GB)',
      f'  buckets: {self.bucket_count} x {self.bucket_elements:,} elements'
      f' ({self.bucket_bytes / 2**20:.0f} MiB fp32), device buckets'
      f' {self.device_buckets} ({self.device_bucket_fraction:.1%})',
      f'  compute      {self.compute_s * ms:10.1f} ms',
      f'  device cast  {self.device_cast_s * ms:10.1f} ms',
      f'  device Adam  {self.device_adam_s * ms:10.1f} ms',
      f'  d2h copies   {self.d2h_s * ms:10.1f} ms',
      f'  h2d copies   {self.h2d_s * ms:10.1f} ms',
      f'  host cast    {self.host_cast_s * ms:10.1f} ms',
      f'  host Adam    {self.host_adam_s * ms:10.1f} ms',
      f'  overlap     -{self.overlap_s * ms:10.1f} ms',
      f'  step total   {self.step_time_s * ms:10.1f} ms:'
      f' {self.tokens_per_s:,.0f} tokens/s, {self.tflops:.1f} TFLOPS,'
      f' accelerator busy {self.device_busy_fraction:.0%}',
    ]
    for name, ref in (
      ('device Adam', self.device_adam),
      ('ZeRO-Offload-style', self.zero_offload),
    ):
      lines.append(
        f'  reference {name}: {ref.step_time_s * ms:.1f} ms,'
        f' {ref.tflops:.1f} TFLOPS, accelerator busy'
        f' {ref.device_busy_fraction:.0%}, fits: {ref.fits}'
      )
    return '\n'.join(lines)


def activation_bytes(model: ModelSpec) -> float:
  """Activation bytes on the accelerator at the peak of backward."""
  s, b, h, p = (
    model.seq_len,
    model.batch,
    model.hidden,
    model.bytes_per_activation,
  )
  sbh = s * b * h
  per_layer = 34 * sbh * p / 2
  if not model.flash_attention:
    heads = model.heads or max(1, h // 128)
    per_layer += 5 * heads * s * s * b * p / 2
  if model.activation_checkpointing:
    layers = model.layers * sbh * p + per_layer
  else:
    layers = model.layers * per_layer
  return layers + 4 * s * b * model.vocab


def default_bucket_elements(params: int) -> int:
  """Bucket size (elements) for a model of `params` parameters."""
  target = min(
    max(params / TARGET_BUCKETS, MIN_BUCKET_ELEMENTS), MAX_BUCKET_ELEMENTS
  )
  return max(1, math.ceil(min(target, params / MIN_BUCKETS)))


def cast_costs(hardware: HardwareProfile, weights: str) -> dict[str, float]:
  """Seconds per parameter per step of each cast side (the decision rule)."""
  w = 2 if weights == 'flow' else 1
  link = hardware.link_bytes_per_s
  return {
    'device': (4 + 4 * w) / link
    + (6 + 6 * w) / (hardware.device_bandwidth_gbs * 1e9),
    'host': (2 + 2 * w) / link
    + CAST_BYTES_PER_PARAM / (hardware.host_cast_gbs * 1e9),
  }


def _choose_cast(hardware: HardwareProfile, weights: str) -> str:
  costs = cast_costs(hardware, weights)
  return 'device' if costs['device'] <= costs['host'] else 'host'


def _staging_bytes(bucket_elements: int, cast: str) -> float:
  """One bucket in flight each way, in the dtype that crosses the link."""
  return 2 * bucket_elements * (4 if cast == 'device' else 2)


def stationary_device_bytes(
  model: ModelSpec, bucket_elements: int, cast: str
) -> float:
  """Device bytes of weight-stationary offload before any device bucket."""
  return (
    OFFLOAD_DEVICE_BYTES_PER_PARAM * model.params
    + activation_bytes(model)
    + _staging_bytes(bucket_elements, cast)
  )


def _bucket_sizes(params: int, bucket_elements: int) -> list[int]:
  """Sizes in arrival order; the short remainder bucket arrives first."""
  count = math.ceil(params / bucket_elements)
  rest = params - bucket_elements * (count - 1)
  return [rest] + [bucket_elements] * (count - 1)


@dataclasses.dataclass(frozen=True)
class _Step:
  """Times (s) and bytes of one offloaded configuration."""

  compute: float
  device_cast: float
  device_adam: float
  d2h: float
  h2d: float
  host_cast: float
  host_adam: float
  step: float
  device_bytes: float
  host_bytes: float
  device_params: int

  @property
  def busy(self) -> float:
    return self.compute + self.device_cast + self.device_adam

  @property
  def overlap(self) -> float:
    host_work = self.d2h + self.h2d + self.host_cast + self.host_adam
    return host_work - (self.step - self.busy)


def _fits(hw: HardwareProfile, device_bytes: float, host_bytes: float) -> bool:
  if hw.unified_memory:
    return device_bytes + host_bytes <= hw.usable_host_bytes
  return (
    device_bytes <= hw.usable_device_bytes
    and host_bytes <= hw.usable_host_bytes
  )


def _compute_times(
  model: ModelSpec, hw: HardwareProfile
) -> tuple[float, float]:
  """Forward and backward (with recomputation) seconds on the accelerator."""
  flop_tokens = model.params * model.tokens / hw.device_flops_per_s
  backward = 4 + (2 if model.activation_checkpointing else 0)
  return 2 * flop_tokens, backward * flop_tokens


def _host_pipeline_end(
  host_sizes: list[int],
  params: int,
  backward: tuple[float, float],
  stage_s_per_param: tuple[float, float, float],
  stv: bool,
) -> float:
  """When the last host bucket is done: copy out, host work, copy back.

  Buckets enter in gradient arrival order (uniform in parameters over the
  backward pass `backward = (start, duration)`); each stage handles one
  bucket at a time. Without STV, host work waits for the end of backward.
  """
  start, duration = backward
  d2h_pp, host_pp, h2d_pp = stage_s_per_param
  d2h_free = host_free = h2d_free = end = 0.0
  arrived = 0
  for size in host_sizes:
    arrived += size
    ready = start + duration * arrived / params
    d2h_free = max(ready, d2h_free) + size * d2h_pp
    begin = d2h_free if stv else max(d2h_free, start + duration)
    host_free = end = max(begin, host_free) + size * host_pp
    if h2d_pp:
      h2d_free = end = max(host_free, h2d_free) + size * h2d_pp
  return end


def _offload_bytes(
  model: ModelSpec, weights: str, cast: str, bucket: int, n_dev: int
) -> tuple[float, float]:
  """Device and host bytes of an offloaded configuration."""
  n = model.params
  fixed = activation_bytes(model) + _staging_bytes(bucket, cast)
  state = DEVICE_BUCKET_STATE_BYTES_PER_PARAM * n_dev
  host = OFFLOAD_HOST_BYTES_PER_PARAM * (n - n_dev)
  if weights == 'flow':
    window = min(n, FLOW_WINDOW_LAYERS * n / model.layers)
    device = OFFLOAD_DEVICE_BYTES_PER_PARAM * (window + n_dev)
    host += 2 * n if cast == 'host' else 0  # The bf16 copy streamed in.
  else:
    device = OFFLOAD_DEVICE_BYTES_PER_PARAM * n
  return device + state + fixed, host


def _offload_step(
  model: ModelSpec,
  hw: HardwareProfile,
  weights: str,
  cast: str,
  sizes: list[int],
  device_buckets: int,
  stv: bool,
) -> _Step:
  """Predicts one SuperOffload step (see the module docstring)."""
  n = model.params
  host_sizes = sizes[: len(sizes) - device_buckets]
  n_host = sum(host_sizes)
  n_dev = n - n_host
  link, hbm = hw.link_bytes_per_s, hw.device_bandwidth_gbs * 1e9
  wire = 4 if cast == 'device' else 2
  fwd, bwd = _compute_times(model, hw)
  compute = fwd + bwd
  if weights == 'flow':
    stream = (n - n_dev) * wire / link  # One pass over the streamed layers.
    fwd, bwd = max(fwd, stream), max(bwd, stream)
    h2d, update_wire, weight_casts = 2 * stream, 0, 2 * (n - n_dev)
  else:
    h2d, update_wire, weight_casts = n_host * wire / link, wire, n_host
  device_cast = 6 * (n_host + weight_casts) / hbm if cast == 'device' else 0.0
  host_cast_pp = (
    CAST_BYTES_PER_PARAM / (hw.host_cast_gbs * 1e9) if cast == 'host' else 0.0
  )
  adam_pp = ADAM_BYTES_PER_PARAM / hw.host_adam_bytes_per_s
  device_adam = n_dev * ADAM_LOWP_BYTES_PER_PARAM / hbm
  host_end = _host_pipeline_end(
    host_sizes,
    n,
    (fwd, bwd),
    (wire / link, host_cast_pp + adam_pp, update_wire / link),
    stv,
  )
  device_end = fwd + bwd + device_cast + device_adam
  device_bytes, host_bytes = _offload_bytes(
    model, weights, cast, sizes[-1], n_dev
  )
  return _Step(
    compute=compute,
    device_cast=device_cast,
    device_adam=device_adam,
    d2h=n_host * wire / link,
    h2d=h2d,
    host_cast=n_host * host_cast_pp,
    host_adam=n_host * adam_pp,
    step=max(device_end, host_end),
    device_bytes=device_bytes,
    host_bytes=host_bytes,
    device_params=n_dev,
  )


def _auto_device_buckets(
  model: ModelSpec,
  hw: HardwareProfile,
  weights: str,
  cast: str,
  sizes: list[int],
  stv: bool,
) -> int:
  """The device-bucket rule of the module docstring."""
  cap = min(
    len(sizes), max(1, math.floor(MAX_DEVICE_BUCKET_FRACTION * len(sizes)))
  )
  times = {}
  for k in range(1, cap + 1):
    step = _offload_step(model, hw, weights, cast, sizes, k, stv)
    host_bytes = step.host_bytes if hw.unified_memory else 0.0
    if _fits(hw, step.device_bytes, host_bytes):
      times[k] = step.step
  if not times:
    return 0
  best = min(times.values())
  return min(
    k for k, t in times.items() if t <= best * (1 + DEVICE_BUCKET_TOLERANCE)
  )


def _estimate(
  model: ModelSpec,
  hw: HardwareProfile,
  step_s: float,
  device_bytes: float,
  host_bytes: float,
  busy_s: float,
) -> Estimate:
  return Estimate(
    step_time_s=step_s,
    fits=_fits(hw, device_bytes, host_bytes),
    device_bytes=device_bytes,
    host_bytes=host_bytes,
    tokens_per_s=model.tokens / step_s,
    tflops=6 * model.params * model.tokens / step_s / 1e12,
    device_busy_fraction=busy_s / step_s,
  )


def device_adam_estimate(model: ModelSpec, hw: HardwareProfile) -> Estimate:
  """Everything, Adam included, on the accelerator."""
  n = model.params
  step = sum(_compute_times(model, hw)) + n * ADAM_LOWP_BYTES_PER_PARAM / (
    hw.device_bandwidth_gbs * 1e9
  )
  device = DEVICE_ADAM_BYTES_PER_PARAM * n + activation_bytes(model)
  return _estimate(model, hw, step, device, 0.0, step)


def zero_offload_estimate(
  model: ModelSpec, hw: HardwareProfile, bucket_elements: int
) -> Estimate:
  """ZeRO-Offload-style: stationary, bf16 link, host cast, all serial."""
  n = model.params
  compute = sum(_compute_times(model, hw))
  step = (
    compute
    + 2 * (2 * n / hw.link_bytes_per_s)
    + n * CAST_BYTES_PER_PARAM / (hw.host_cast_gbs * 1e9)
    + n * ADAM_BYTES_PER_PARAM / hw.host_adam_bytes_per_s
  )
  device = stationary_device_bytes(model, bucket_elements, 'host')
  host = OFFLOAD_HOST_BYTES_PER_PARAM * n
  return _estimate(model, hw, step, device, host, compute)


_EMBEDDING_NAMES = ('embed', 'wte', 'vocab', 'token')


def _spec_from_tree(tree: Any, **fields: Any) -> ModelSpec:
  """A `ModelSpec` from a params pytree; `fields` that are None are inferred.

  Hidden size: the most frequent dimension of the leaves with two or more
  dimensions. Vocabulary: the other dimension of a 2-D leaf whose path names
  an embedding. Layers: (params - vocab hidden) / (12 hidden^2), at least 1.
  """
  with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not with_paths:
    raise ValueError('plan() got an empty params pytree')
  shapes = {}
  for path, leaf in with_paths:
    shape = getattr(leaf, 'shape', None)
    if shape is None:
      raise TypeError(
        f'params leaf {jax.tree_util.keystr(path)} is a '
        f'{type(leaf).__name__}, not an array'
      )
    shapes[jax.tree_util.keystr(path)] = tuple(int(d) for d in shape)
  params = sum(math.prod(s) for s in shapes.values())
  if params < 1:
    raise ValueError(f'params pytree has no elements: {shapes}')
  hidden = fields.pop('hidden')
  if hidden is None:
    dims = Counter(d for s in shapes.values() if len(s) >= 2 for d in s)
    hidden = dims.most_common(1)[0][0] if dims else max(1, math.isqrt(params))
  vocab = fields.pop('vocab')
  if vocab is None:
    vocab = ModelSpec.vocab
    for path, s in shapes.items():
      name = path.lower()
      if (
        len(s) == 2 and hidden in s and any(k in name for k in _EMBEDDING_NAMES)
      ):
        vocab = s[1] if s[0] == hidden else s[0]
        break
  layers = fields.pop('layers')
  if layers is None:
    layers = max(1, round((params - vocab * hidden) / (12 * hidden**2)))
  fields = {k: v for k, v in fields.items() if v is not None}
  return ModelSpec(
    params=params, layers=layers, hidden=hidden, vocab=vocab, **fields
  )


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f'{name} must be one of {choices}, got {value!r}')


def _resolve_policies(
  spec: ModelSpec,
  hw: HardwareProfile,
  weights: str,
  cast: str,
  bucket_elements: int | str,
  device_buckets: int | str,
  stv: bool,
) -> tuple[str, str, int, int]:
  """Applies the decision rules to the arguments left at 'auto'."""
  _check_choice('weights', weights, ('auto', 'stationary', 'flow'))
  _check_choice('cast', cast, ('auto', 'device', 'host'))
  if bucket_elements == 'auto':
    bucket_elements = default_bucket_elements(spec.params)
  elif (
    not isinstance(bucket_elements, (int, np.integer)) or bucket_elements < 1
  ):
    raise ValueError(
      "bucket_elements must be 'auto' or a positive integer, got "
      f'{bucket_elements!r}'
    )
  bucket_elements = int(bucket_elements)
  sizes = _bucket_sizes(spec.params, bucket_elements)
  if weights == 'auto':
    stationary_cast = _choose_cast(hw, 'stationary') if cast == 'auto' else cast
    need = stationary_device_bytes(spec, bucket_elements, stationary_cast)
    stationary = hw.unified_memory or need <= hw.usable_device_bytes
    weights = 'stationary' if stationary else 'flow'
  if cast == 'auto':
    cast = _choose_cast(hw, weights)
  if device_buckets == 'auto':
    device_buckets = _auto_device_buckets(spec, hw, weights, cast, sizes, stv)
  elif not isinstance(
    device_buckets, (int, np.integer)
  ) or not 0 <= device_buckets <= len(sizes):
    raise ValueError(
      f"device_buckets must be 'auto' or an integer in [0, {len(sizes)}] "
      f'(the bucket count), got {device_buckets!r}'
    )
  return weights, cast, bucket_elements, int(device_buckets)


def plan(
  model: ModelSpec | Any,
  hardware: HardwareProfile = GH200,
  *,
  seq_len: int | None = None,
  batch: int | None = None,
  layers: int | None = None,
  hidden: int | None = None,
  vocab: int | None = None,
  weights: str = 'auto',
  cast: str = 'auto',
  bucket_elements: int | str = 'auto',
  device_buckets: int | str = 'auto',
  stv: bool = True,
) -> Plan:
  """Chooses SuperOffload's policies for a model and predicts its step.

  A cost model (see the module docstring for every formula and assumption):
  the weights policy, the casting side, the bucket size and the number of
  buckets whose Adam stays on the accelerator, and the step time they give,
  with device-resident Adam and a ZeRO-Offload-style baseline for reference.

  Examples:
    >>> import jax_superoffload as so
    >>> p = so.plan(so.ModelSpec.from_params(13e9, seq_len=4096), so.GH200)
    >>> print(p)  # doctest: +SKIP
    >>> tx = so.adamw(1e-4, bucket_bytes=p.bucket_bytes)  # doctest: +SKIP

  Args:
    model: A `ModelSpec`, or a params pytree (arrays or
      `jax.ShapeDtypeStruct`s) whose leaf sizes are counted.
    hardware: The accelerator and host (`GH200`, `H100_PCIE`, `H200_PCIE`,
      `CPU_ONLY`, `HardwareProfile.measured()` or your own).
    seq_len: Tokens per sequence; overrides the `ModelSpec`'s.
    batch: Sequences per step; overrides the `ModelSpec`'s.
    layers: Transformer blocks (pytree input: inferred when None).
    hidden: Residual width (pytree input: inferred when None).
    vocab: Vocabulary size (pytree input: inferred when None).
    weights: 'auto', 'stationary' or 'flow'.
    cast: 'auto', 'device' or 'host'.
    bucket_elements: 'auto' or elements per bucket.
    device_buckets: 'auto' or the number of last-arriving buckets whose Adam
      runs on the accelerator.
    stv: Speculation-then-validation: host Adam starts per bucket during
      backward rather than after the global gradient norm is known.

  Returns:
    A `Plan`; `print(plan)` shows the parts of the predicted step.
  """
  overrides = dict(
    seq_len=seq_len, batch=batch, layers=layers, hidden=hidden, vocab=vocab
  )
  if isinstance(model, ModelSpec):
    spec = dataclasses.replace(
      model, **{k: v for k, v in overrides.items() if v is not None}
    )
  else:
    spec = _spec_from_tree(model, **overrides)
  hw = hardware
  weights, cast, bucket_elements, device_buckets = _resolve_policies(
    spec, hw, weights, cast, bucket_elements, device_buckets, stv
  )
  sizes = _bucket_sizes(spec.params, bucket_elements)
  step = _offload_step(spec, hw, weights, cast, sizes, device_buckets, stv)
  ref = _estimate(
    spec, hw, step.step, step.device_bytes, step.host_bytes, step.busy
  )
  return Plan(
    model=spec,
    hardware=hw,
    weights=weights,
    cast=cast,
    bucket_elements=bucket_elements,
    bucket_bytes=4 * bucket_elements,
    bucket_count=len(sizes),
    device_buckets=device_buckets,
    device_bucket_fraction=device_buckets / len(sizes),
    device_params=step.device_params,
    fits=ref.fits,
    device_bytes=step.device_bytes,
    host_bytes=step.host_bytes,
    activation_bytes=activation_bytes(spec),
    compute_s=step.compute,
    device_cast_s=step.device_cast,
    device_adam_s=step.device_adam,
    d2h_s=step.d2h,
    h2d_s=step.h2d,
    host_cast_s=step.host_cast,
    host_adam_s=step.host_adam,
    overlap_s=step.overlap,
    step_time_s=step.step,
    tokens_per_s=ref.tokens_per_s,
    tflops=ref.tflops,
    device_busy_fraction=ref.device_busy_fraction,
    device_adam=device_adam_estimate(spec, hw),
    zero_offload=zero_offload_estimate(spec, hw, bucket_elements),
  )
