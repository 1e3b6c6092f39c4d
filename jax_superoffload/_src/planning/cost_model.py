"""The planner's cost model: memory and step time of one training setup.

A cost model, not a measurement. It predicts the bytes and the step time of
a model trained with SuperOffload's policies, with device-resident Adam and
with a ZeRO-Offload-style baseline, on a `HardwareProfile`. `planner` picks
the policies from these predictions.

Model (N parameters, T = seq_len x batch tokens per step):

* **Compute.** Forward 2NT, backward 4NT FLOPs, plus a 2NT recomputed
  forward with activation checkpointing, at `peak x device_mfu`. Attention
  score FLOPs are not counted (about s / 6h of 6NT, e.g. 13% at s = 4096,
  h = 5120). Gradients arrive uniformly in parameters over the backward
  pass, last for the first layers and the embeddings.
* **Activations** (Korthikanti et al. 2022, bytes): 34 sbh x
  (bytes_per_activation / 2) per layer; with checkpointing only each
  layer's input (sbh x bytes) is kept, plus one layer's full set during
  its recomputation. Plus fp32 logits, 4 sbV (their gradient overwrites
  them). Flash attention keeps no scores. Without it the scores are
  counted as `jax.nn.dot_product_attention`'s XLA implementation keeps
  them, not as Korthikanti's 5as/h: the fp32 softmax and the
  probabilities in the activations' dtype, 6 B per score with bf16
  activations (`score_bytes_per_element`), per stored layer, and, with
  checkpointing, as much again while the rebuilt layer's backward holds
  their gradients.
* **Memory per parameter.** The weights and gradients on the device are
  the `ModelSpec`'s dtypes (`bytes_per_param`, `bytes_per_grad`; 16-bit
  by default). Device-resident Adam: weights, gradients, an fp32 master
  (16-bit weights only), m and v: 16 B either way (bf16: 2 + 2 + 4 + 8;
  fp32: 4 + 4 + 8). Offloaded: weights and gradients on the device (4 B
  16-bit, 8 B fp32; a jitted step holds the whole gradient tree). On the
  host, the library's state: fp32 master, m and v (12 B, what
  `adamw(...).init` allocates, for fp32 weights too); the new weights
  a bucket's host step returns it writes over the bucket's gradients, on
  the device (weight-stationary; weight-flow streams a 16-bit copy in,
  `returned_weight_bytes`). The `stream` executor stages each bucket through
  two pinned host slots it allocates itself (`staging_bytes`, host bytes
  XLA does not count), and holds no bucket in device memory but where it
  casts 16-bit weights on the device: one bucket each way in fp32
  (`cast_staging_bytes`; its compiled step casting on the host needs what
  optax's needs less the state). STV with fp32 moments adds the spare
  row of its double-buffered state, fp32 master, m and v, and the fp32
  gradients its speculative pass keeps for a redo (+16 B, 28 B in all).
  With low-precision moments (`moments`) m and v take 2 B each (bf16) or
  1 B each plus an fp32 scale per 256 (8-bit): 8 or about 6 B on the host
  instead of 12; their STV steps after the verdict, with no spare row and
  no kept gradients (`stv_form`). The ZeRO-Offload baseline keeps the
  fp32 gradient on the host too (16 B, Ren et al. 2021), and one bucket
  each way in device memory.
  Weight-flow keeps two layers' weights and gradients on the device
  and a 16-bit (host cast) copy of the weights on the host (+2 B). A
  bucket kept on the device adds its fp32 master (16-bit weights only), m
  and v there (12 B; with weight-flow also its resident weights and
  gradients) and leaves the host.
* **Transfers.** Gradients go device-to-host, new weights host-to-device,
  fp32 (4 B) when casting on the device, in their own dtypes when casting
  on the host (2 B each for 16-bit ones); the link is full duplex.
  Weight-flow streams the weights in twice a step (forward; backward with
  its recomputation), in the dtype that crosses the link (fp32 when
  casting on the device, cast again each pass), overlapped with compute
  layer by layer: a pass takes max(compute, stream).
* **Casts.** Device: 16-bit grads up, weights down, 6 B per element per
  cast at HBM bandwidth. Host: the same 12 B per parameter at
  `host_cast_gbs`. fp32 weights and gradients need no cast.
* **Host Adam** streams 28 B per parameter at `host_bandwidth_gbs x
  host_adam_efficiency` (20 B with bf16 moments, about 16 B with 8-bit
  ones), memory-bound, except 8-bit moments where the profile's measured
  `host_q8_gparams_s` is slower (their codec is compute-bound on few
  cores; profiles that do not measure it assume memory-bound);
  with STV the speculative pass also writes the gradients it read, as
  fp32 (+4 B, 32 B in all), so that a clipped step
  can be taken again from the untouched state after validation: that redo
  is one more 28 B pass over the host buckets, after backward, on the
  clipped steps only (`stv_redo`, not in the step time). With speculation
  (STV on fp32 moments) each bucket's Adam starts when its gradients reach
  the host (after backward otherwise, low-precision moments' STV too); the
  buckets go through a three-stage pipeline (device-to-host copy, host
  cast + Adam, host-to-device copy), one bucket at a time per stage, which
  is what overlaps them with backward.
  The step ends when the device is done and the last bucket is back.
* **ZeRO-Offload-style baseline**: weight-stationary, bf16 over the link,
  cast on the host, every bucket on the CPU, no STV and no overlap: compute,
  then copies, casts, Adam and copies, one after another.

Against the compiled step (`python -m experiments.device.aot_planner
AOT_JSON`: the trainer's step compiled for a GPU without one, by the
XLA:GPU of the 0.12.0.1 CUDA plugin; results/gpu_aot/): for the programs
modelled here, optax.adamw with fp32 weights and the `stream` executor
with its host steps after the backward pass, the device bytes are within
10% of XLA's at every size tested (two and four layers of width 256, the
1B preset scanned or unrolled, the 8B config, and the capacity search's
16 to 584 layers of the 1B width: from 5% under to 7% over) and the host
bytes within 3%. The returned 16-bit weights are an upper bound: XLA may
free some before others arrive (0.43 B/param at two layers of the 8B
width, 2 at 32). Where the rebuilt layer's activations are most of the
step, the agreement is looser, as XLA packs that layer's buffers
differently by shape and dtype. Per attention score it takes 7 to 14 B
(8B and 1B widths, fp32 or bf16 weights) where this model counts 12, so
two layers of those widths come out up to 16% over. Where the scores are
not most of a layer (few heads, short sequences), XLA keeps more per
token than 34 sbh: two layers of width 256 with two heads of 128 and
4 x 256 tokens, 19% under (but 21% over with four heads of 64 and
2 x 512 tokens; results/gpu_aot/planner_vs_compiled_2026-12-07.txt).
Not modelled: optax on 16-bit weights (no fp32 master, 16-bit moments),
host-compute executors (`ffi`, `xla_host`: XLA stages the state through
host buffers of its own), `device` (the state copied in),
`overlap_scan`'s rows with 16-bit weights (each stack's fp32 master
returns to the device), and compilers that place the returned 16-bit
weights in device memory (jax 0.12.1: 7.7 GB at 8B). Casting on the
device, the buckets cast in device memory are counted though the
compiled step casts them after the backward pass, under its
activations' peak.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jax_superoffload._src.planning.hardware import ADAM_BYTES_PER_PARAM
from jax_superoffload._src.planning.hardware import ADAM_LOWP_BYTES_PER_PARAM
from jax_superoffload._src.planning.hardware import HardwareProfile

# Bytes a host cast pass moves per parameter: grads bf16 -> fp32 (2 read +
# 4 written) and weights fp32 -> bf16 (4 read + 2 written). 16-bit weights
# and gradients; `cast_bytes` has those of any `ModelSpec`.
CAST_BYTES_PER_PARAM = 12
# Offloaded: the library's host state, fp32 master, m and v (its init;
# no gradient is kept without STV; checked by test_planner against
# `adamw(...).init`).
OFFLOAD_HOST_BYTES_PER_PARAM = 12
# ZeRO-Offload (Ren et al. 2021) keeps fp32 master, m, v and the fp32
# gradient on the host: the baseline's host bytes.
ZERO_OFFLOAD_HOST_BYTES_PER_PARAM = 16
# STV's spare row of the host state (fp32 master, m and v): see stv.py.
STV_SPARE_HOST_BYTES_PER_PARAM = 12
# STV's speculative pass also writes the gradients it read, as fp32, into
# host buffers of the state (`grace_adam.speculate`'s `kept`).
STV_KEPT_GRAD_BYTES_PER_PARAM = 4
# Bytes per parameter of m and v together, by storage format (`moments`).
MOMENT_BYTES_PER_PARAM = {'fp32': 8.0, 'bf16': 4.0, '8bit': 2.0 + 8.0 / 256}


def moment_bytes(moments: str) -> float:
  if moments not in MOMENT_BYTES_PER_PARAM:
    raise ValueError(
      f'moments must be one of {tuple(MOMENT_BYTES_PER_PARAM)}, got {moments!r}'
    )
  return MOMENT_BYTES_PER_PARAM[moments]


def host_adam_bytes_per_param(moments: str = 'fp32') -> float:
  """Bytes a host Adam step moves: master and moments both ways, grad in."""
  return ADAM_BYTES_PER_PARAM - 2 * (8.0 - moment_bytes(moments))


# Weight-flow keeps this many layers of weights and gradients on the device.
FLOW_WINDOW_LAYERS = 2
# Bytes per weight or gradient element a `ModelSpec` may hold: 16-bit
# (bf16, fp16) or fp32.
WEIGHT_BYTES = (2, 4)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A decoder-only transformer as the cost model sees it.

  Attributes:
    params: Parameter count.
    layers: Transformer blocks.
    hidden: Width of the residual stream.
    seq_len: Tokens per sequence.
    batch: Sequences per step on this accelerator.
    heads: Attention heads (only used without flash attention); None:
      hidden / 128.
    vocab: Vocabulary size (logits memory).
    bytes_per_activation: Bytes per stored activation (2 for bf16).
    activation_checkpointing: Keep only layer inputs and recompute the rest
      in backward.
    flash_attention: Attention scores are not stored (flash attention).
    bytes_per_param: Bytes per weight on the accelerator: 2 (bf16 or fp16
      weights, with an fp32 master in the optimizer's state) or 4 (fp32
      weights, their own master).
    bytes_per_grad: Bytes per gradient element on the accelerator (2 or 4);
      None: those of the weights (as JAX's gradients are).
  """

  params: int
  layers: int
  hidden: int
  seq_len: int = 2048
  batch: int = 8
  heads: int | None = None
  vocab: int = 32000
  bytes_per_activation: int = 2
  activation_checkpointing: bool = True
  flash_attention: bool = True
  bytes_per_param: int = 2
  bytes_per_grad: int | None = None

  def __post_init__(self):
    for name in ('params', 'layers', 'hidden', 'seq_len', 'batch', 'vocab'):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f'{name} must be a positive integer, got {value!r}')
    for name in ('bytes_per_param', 'bytes_per_grad'):
      value = getattr(self, name)
      unset = name == 'bytes_per_grad' and value is None
      if value not in WEIGHT_BYTES and not unset:
        raise ValueError(f'{name} must be one of {WEIGHT_BYTES}, got {value!r}')

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

  @property
  def grad_bytes(self) -> int:
    """Bytes per gradient element on the accelerator."""
    if self.bytes_per_grad is None:
      return self.bytes_per_param
    return self.bytes_per_grad

  @property
  def master_bytes(self) -> int:
    """Bytes per parameter of an fp32 master kept beside the weights.

    16-bit weights need one; fp32 weights are their own master.
    """
    return 4 if self.bytes_per_param < 4 else 0


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
  scores = 0.0
  if not model.flash_attention:
    heads = model.heads or max(1, h // 128)
    scores = score_bytes_per_element(p) * heads * s * s * b
  if model.activation_checkpointing:
    # The rebuilt layer's backward holds its scores' gradients beside them.
    layers = model.layers * sbh * p + per_layer + 2 * scores
  else:
    # Each layer's backward frees what it kept as it goes: room for the
    # gradients of its scores.
    layers = model.layers * (per_layer + scores)
  return layers + 4 * s * b * model.vocab


def score_bytes_per_element(bytes_per_activation: int) -> int:
  """Bytes per attention score `jax.nn.dot_product_attention` keeps.

  Its XLA implementation (no flash attention) keeps the fp32 softmax and
  the probabilities in the activations' dtype for the backward pass, and
  that pass holds the gradients of both at once.
  """
  return 4 + bytes_per_activation if bytes_per_activation < 4 else 4


def wire_bytes(model: ModelSpec, cast: str) -> tuple[int, int]:
  """Bytes per element crossing the link: (gradients out, weights back).

  Casting on the device, both cross as fp32; casting on the host, each in
  its own dtype (fp32 weights and gradients need no cast on either side).
  """
  if cast == 'device':
    return 4, 4
  return model.grad_bytes, model.bytes_per_param


def cast_bytes(model: ModelSpec) -> tuple[int, int]:
  """Bytes a cast pass moves per element: (gradients up, weights down).

  16-bit to fp32 reads 2 and writes 4, and back; fp32 needs no cast (0).
  """
  grads = model.grad_bytes + 4 if model.grad_bytes < 4 else 0
  weights = 4 + model.bytes_per_param if model.bytes_per_param < 4 else 0
  return grads, weights


def weight_grad_bytes(model: ModelSpec) -> int:
  """Device bytes per parameter of the weights and their gradients."""
  return model.bytes_per_param + model.grad_bytes


def device_adam_bytes_per_param(model: ModelSpec) -> int:
  """Device-resident Adam's bytes per parameter on the device.

  Weights, gradients, an fp32 master (16-bit weights only), m and v: 16 B
  with 16-bit or fp32 weights alike.
  """
  return weight_grad_bytes(model) + model.master_bytes + 8


def staging_bytes(model: ModelSpec, bucket_elements: int, cast: str) -> float:
  """Host bytes of the stream executor's two pinned staging slots.

  Each holds what one bucket's host step stages (`steps.staging_bound`):
  its gradients as they cross, its weights (the re-seed reads them) and
  the new weights it writes back over its gradients, in their dtype (not
  when casting 16-bit weights on the device: then the fp32 masters are
  copied after the join). The library allocates them itself, outside
  XLA's accounting.
  """
  grads, _ = wire_bytes(model, cast)
  cast_on_device = cast == 'device' and model.bytes_per_param < 4
  written = 0 if cast_on_device else model.bytes_per_param
  per_element = grads + model.bytes_per_param + written
  return 2 * bucket_elements * per_element


def cast_staging_bytes(
  model: ModelSpec, bucket_elements: int, cast: str
) -> float:
  """Device bytes of one bucket cast on the device each way, in fp32.

  Casting 16-bit weights on the device, a bucket's gradients are cast up
  and its new fp32 weights arrive to be cast down. Otherwise the stream
  executor reads and writes the step's own buffers: its compiled step
  casting on the host needs what optax's needs less the state. Counted
  whole, though the compiled step (host steps after the backward pass)
  casts while the backward's activations are freed, under their peak.
  """
  if cast != 'device' or not any(cast_bytes(model)):
    return 0.0
  return 2 * bucket_elements * 4


def stationary_device_bytes(
  model: ModelSpec, bucket_elements: int, cast: str
) -> float:
  """Device bytes of weight-stationary offload before any device bucket."""
  return (
    weight_grad_bytes(model) * model.params
    + activation_bytes(model)
    + cast_staging_bytes(model, bucket_elements, cast)
  )


def stv_form(stv: bool, moments: str = 'fp32') -> str:
  """How the library runs STV for these moments (executors.for_name).

  'double_buffered': fp32 moments step speculatively on two rows of the
  host state during backward and redo a clipped step from the untouched
  row (a spare row and the kept gradients on the host). 'after_verdict':
  bf16 and 8-bit moments, updated in place, step once the global norm is
  known (no spare row, but the host step waits for backward, as without
  STV). 'off': no clipping or skipping armed.
  """
  if not stv:
    return 'off'
  moment_bytes(moments)  # Checked.
  return 'double_buffered' if moments == 'fp32' else 'after_verdict'


def speculates(stv: bool, moments: str = 'fp32') -> bool:
  """Whether host Adam starts per bucket during backward (see stv_form)."""
  return stv_form(stv, moments) == 'double_buffered'


def offload_host_bytes_per_param(stv: bool, moments: str = 'fp32') -> float:
  """Host bytes per parameter of a host bucket (weight-stationary)."""
  smaller = 8.0 - moment_bytes(moments)  # Than fp32 m and v.
  spare = 0.0
  if speculates(stv, moments):
    spare = STV_SPARE_HOST_BYTES_PER_PARAM + STV_KEPT_GRAD_BYTES_PER_PARAM
  return OFFLOAD_HOST_BYTES_PER_PARAM - smaller + spare


def _offload_bytes(
  model: ModelSpec,
  weights: str,
  cast: str,
  bucket: int,
  n_dev: int,
  stv: bool,
  moments: str = 'fp32',
) -> tuple[float, float]:
  """Device and host bytes of an offloaded configuration."""
  n = model.params
  # A device bucket's fp32 master (16-bit weights only), m and v.
  state = (model.master_bytes + 8) * n_dev
  host = offload_host_bytes_per_param(stv, moments) * (n - n_dev)
  host += staging_bytes(model, bucket, cast) if n_dev < n else 0
  if weights == 'flow':
    returned = returned_weight_bytes(cast, model.bytes_per_param)
    window = min(n, FLOW_WINDOW_LAYERS * n / model.layers)
    device = weight_grad_bytes(model) * (window + n_dev)
    host += returned * n  # The 16-bit copy streamed in.
  else:
    # The stream executor writes the new weights over their gradients on
    # the device: no buffers of their own, on either side.
    device = weight_grad_bytes(model) * n
  fixed = activation_bytes(model) + cast_staging_bytes(model, bucket, cast)
  return device + state + fixed, host


def returned_weight_bytes(cast: str, bytes_per_param: int = 2) -> float:
  """Host bytes per host-bucket parameter of the weights the step returns.

  Casting 16-bit weights on the host, the host step writes the new
  weights into host buffers that XLA allocates for the step's results and
  frees after their copies to the device. The compiled stream step
  (deviceless, H200 target) keeps them all at once: its host temporaries
  are 1.83 B/param at the 1B width, 16 and 64 layers alike, and 2 B/param
  at the tests' small width. Casting on the device, or with fp32 weights
  (their own master), the weights are copied from the state itself: no
  host bytes (the compiled step's host bytes are its state's;
  tests/test_capacity.py).
  """
  if cast == 'host' and bytes_per_param < 4:
    return float(bytes_per_param)
  return 0.0


def fits_memory(
  hw: HardwareProfile, device_bytes: float, host_bytes: float
) -> bool:
  """Whether the bytes fit in the usable device and host memories."""
  if hw.unified_memory:
    return device_bytes + host_bytes <= hw.usable_host_bytes
  return (
    device_bytes <= hw.usable_device_bytes
    and host_bytes <= hw.usable_host_bytes
  )


def bucket_sizes(params: int, bucket_elements: int) -> list[int]:
  """Sizes in arrival order; the short remainder bucket arrives first."""
  count = math.ceil(params / bucket_elements)
  rest = params - bucket_elements * (count - 1)
  return [rest] + [bucket_elements] * (count - 1)


@dataclasses.dataclass(frozen=True)
class OffloadStep:
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
  stv_redo: float = 0.0  # A clipped step's redo: on those steps only.

  @property
  def busy(self) -> float:
    return self.compute + self.device_cast + self.device_adam

  @property
  def overlap(self) -> float:
    host_work = self.d2h + self.h2d + self.host_cast + self.host_adam
    return host_work - (self.step - self.busy)


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


def offload_step(
  model: ModelSpec,
  hw: HardwareProfile,
  weights: str,
  cast: str,
  sizes: list[int],
  device_buckets: int,
  stv: bool,
  moments: str = 'fp32',
) -> OffloadStep:
  """Predicts one SuperOffload step (see the module docstring)."""
  n = model.params
  host_sizes = sizes[: len(sizes) - device_buckets]
  n_host = sum(host_sizes)
  n_dev = n - n_host
  link, hbm = hw.link_bytes_per_s, hw.device_bandwidth_gbs * 1e9
  grad_wire, weight_wire = wire_bytes(model, cast)
  fwd, bwd = _compute_times(model, hw)
  compute = fwd + bwd
  if weights == 'flow':
    # One pass over the streamed layers, in the dtype that crosses.
    stream = (n - n_dev) * weight_wire / link
    fwd, bwd = max(fwd, stream), max(bwd, stream)
    h2d, update_wire, weight_casts = 2 * stream, 0, 2 * (n - n_dev)
  else:
    h2d = n_host * weight_wire / link
    update_wire, weight_casts = weight_wire, n_host
  device_cast = 0.0
  if cast == 'device':
    grad_cast, weight_cast = cast_bytes(model)
    device_cast = (grad_cast * n_host + weight_cast * weight_casts) / hbm
  host_cast_pp, adam_pp, redo_pp = _host_seconds_per_param(
    model, hw, cast, stv, moments
  )
  device_adam = n_dev * ADAM_LOWP_BYTES_PER_PARAM / hbm
  host_end = _host_pipeline_end(
    host_sizes,
    n,
    (fwd, bwd),
    (grad_wire / link, host_cast_pp + adam_pp, update_wire / link),
    speculates(stv, moments),
  )
  device_end = fwd + bwd + device_cast + device_adam
  device_bytes, host_bytes = _offload_bytes(
    model, weights, cast, sizes[-1], n_dev, stv, moments
  )
  return OffloadStep(
    compute=compute,
    device_cast=device_cast,
    device_adam=device_adam,
    d2h=n_host * grad_wire / link,
    h2d=h2d,
    host_cast=n_host * host_cast_pp,
    host_adam=n_host * adam_pp,
    step=max(device_end, host_end),
    device_bytes=device_bytes,
    host_bytes=host_bytes,
    device_params=n_dev,
    stv_redo=n_host * redo_pp,
  )


def _host_seconds_per_param(
  model: ModelSpec, hw: HardwareProfile, cast: str, stv: bool, moments: str
) -> tuple[float, float, float]:
  """Host seconds per parameter: the cast, Adam, and an STV redo (or 0)."""
  host_cast = 0.0
  if cast == 'host':
    host_cast = sum(cast_bytes(model)) / (hw.host_cast_gbs * 1e9)
  speculative = speculates(stv, moments)
  adam_bytes = host_adam_bytes_per_param(moments) + (
    STV_KEPT_GRAD_BYTES_PER_PARAM if speculative else 0
  )
  adam = hw.host_adam_seconds_per_param(adam_bytes, moments)
  redo = 0.0
  if speculative:
    redo = hw.host_adam_seconds_per_param(
      host_adam_bytes_per_param(moments), moments
    )
  return host_cast, adam, redo


def make_estimate(
  model: ModelSpec,
  hw: HardwareProfile,
  step_s: float,
  device_bytes: float,
  host_bytes: float,
  busy_s: float,
) -> Estimate:
  """An `Estimate` from a step time, its bytes and its busy seconds."""
  return Estimate(
    step_time_s=step_s,
    fits=fits_memory(hw, device_bytes, host_bytes),
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
  device = device_adam_bytes_per_param(model) * n + activation_bytes(model)
  return make_estimate(model, hw, step, device, 0.0, step)


def zero_offload_estimate(
  model: ModelSpec, hw: HardwareProfile, bucket_elements: int
) -> Estimate:
  """ZeRO-Offload-style: stationary, host cast, all serial.

  Its gradients and weights cross in their own dtypes (bf16 by default),
  through one bucket each way in device memory.
  """
  n = model.params
  compute = sum(_compute_times(model, hw))
  step = (
    compute
    + n * sum(wire_bytes(model, 'host')) / hw.link_bytes_per_s
    + n * sum(cast_bytes(model)) / (hw.host_cast_gbs * 1e9)
    + n * ADAM_BYTES_PER_PARAM / hw.host_adam_bytes_per_s
  )
  buckets = 2 * bucket_elements * max(wire_bytes(model, 'host'))
  device = weight_grad_bytes(model) * n + activation_bytes(model) + buckets
  host = ZERO_OFFLOAD_HOST_BYTES_PER_PARAM * n
  return make_estimate(model, hw, step, device, host, compute)
