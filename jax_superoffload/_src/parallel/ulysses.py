"""Ulysses sequence parallelism: all-to-all from sequence to head sharding.

DeepSpeed-Ulysses (Jacobs et al., arXiv 2309.14509) shards activations along
the sequence. Around attention, one all-to-all turns each device's
`[B, S/P, H, D]` shard into `[B, S, H/P, D]` (every device sees the whole
sequence for its own heads), attention runs locally, and a second all-to-all
turns the result back.
"""

# ruff: noqa: N803, N806

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AttentionFn = Callable[..., jax.Array]
AxisName = str | tuple[str, ...]

_SEQ_AXIS = 1
_HEAD_AXIS = 2


def _axis_names(axis: AxisName | None) -> tuple[str, ...]:
  if axis is None:
    return ()
  return (axis,) if isinstance(axis, str) else tuple(axis)


def _check_divisible(what: str, n: int, axis: AxisName, size: int) -> None:
  if n % size:
    raise ValueError(
      f'{what} ({n}) must be divisible by the sequence-parallel size '
      f'({size}) of mesh axis {axis!r}'
    )


def seq_to_heads(x_BxSpxHxD: jax.Array, axis: AxisName) -> jax.Array:
  """Moves [B, S/P, H, D] to [B, S, H/P, D].

  For use inside `jax.shard_map` over mesh axis `axis` (of size P); the local
  head count `H` must be divisible by P. Differentiable: the transpose is
  `heads_to_seq`.

  Args:
    x_BxSpxHxD: this device's sequence shard.
    axis: the sequence-parallel mesh axis name (or tuple of names).

  Returns:
    The whole sequence for this device's `H/P` heads; device `i` holds heads
    `[i * H/P, (i + 1) * H/P)`.
  """
  size = jax.lax.axis_size(axis)
  _check_divisible('heads', x_BxSpxHxD.shape[_HEAD_AXIS], axis, size)
  return jax.lax.all_to_all(
    x_BxSpxHxD, axis, split_axis=_HEAD_AXIS, concat_axis=_SEQ_AXIS, tiled=True
  )


def heads_to_seq(x_BxSxHpxD: jax.Array, axis: AxisName) -> jax.Array:
  """Moves [B, S, H/P, D] to [B, S/P, H, D].

  The inverse of `seq_to_heads`, for use inside `jax.shard_map` over mesh
  axis `axis` (of size P); the sequence length `S` must be divisible by P.

  Args:
    x_BxSxHpxD: the whole sequence for this device's `H/P` heads.
    axis: the sequence-parallel mesh axis name (or tuple of names).

  Returns:
    This device's sequence shard for all `H` heads.
  """
  size = jax.lax.axis_size(axis)
  _check_divisible('sequence length', x_BxSxHpxD.shape[_SEQ_AXIS], axis, size)
  return jax.lax.all_to_all(
    x_BxSxHpxD, axis, split_axis=_SEQ_AXIS, concat_axis=_HEAD_AXIS, tiled=True
  )


def kv_repeat_factor(kv_heads: int, axis_size: int) -> int:
  """How many times each kv head is repeated before the all-to-all.

  The smallest `r` with `kv_heads * r` divisible by `axis_size`, that is
  `axis_size // gcd(kv_heads, axis_size)`, giving `lcm(kv_heads, axis_size)`
  kv heads. As both `kv_heads` and `axis_size` divide the query heads, so
  does the lcm, and repeating each head in place (`jnp.repeat`) keeps query
  head `n` paired with the same original kv head `n // (H / kv_heads)`.

  Args:
    kv_heads: key/value heads `Hkv`.
    axis_size: sequence-parallel size `P`.

  Returns:
    The repeat factor; 1 when `axis_size` already divides `kv_heads`.
  """
  return axis_size // math.gcd(kv_heads, axis_size)


def _axis_size(mesh: Mesh, axis: AxisName) -> int:
  return math.prod(mesh.shape[name] for name in _axis_names(axis))


def _validate(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array | None,
  kv_mask: jax.Array | None,
  mesh: Mesh,
  axis: AxisName,
  batch_axis: AxisName | None,
) -> None:
  """Checks shapes against the mesh before any collective is traced."""
  for name in _axis_names(axis) + _axis_names(batch_axis):
    if name not in mesh.shape:
      raise ValueError(
        f'mesh axis {name!r} not in the mesh axes {tuple(mesh.axis_names)}'
      )
  if set(_axis_names(axis)) & set(_axis_names(batch_axis)):
    raise ValueError(f'axis {axis!r} and batch_axis {batch_axis!r} overlap')
  for name, x in (('q', q), ('k', k), ('v', v)):
    if x.ndim != 4:
      raise ValueError(
        f'{name} must have rank 4 [B, S, H, D], got shape {x.shape}'
      )
  if k.shape != v.shape:
    raise ValueError(
      f'k and v must have the same shape, got k {k.shape} and v {v.shape}'
    )
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(
      f'q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}'
    )
  B, S, H, D = q.shape
  _, Skv, Hkv, Dkv = k.shape
  if k.shape[0] != B or Dkv != D:
    raise ValueError(
      f'q {q.shape} and k/v {k.shape} must agree on batch and head dim'
    )
  if H % Hkv:
    raise ValueError(
      f'query heads ({H}) must be a multiple of kv heads ({Hkv})'
    )
  size = _axis_size(mesh, axis)
  _check_divisible('sequence length', S, axis, size)
  _check_divisible('kv sequence length', Skv, axis, size)
  _check_divisible('query heads', H, axis, size)
  batch_size = _axis_size(mesh, batch_axis) if batch_axis else 1
  if B % batch_size:
    raise ValueError(
      f'batch ({B}) must be divisible by the size ({batch_size}) of '
      f'batch_axis {batch_axis!r}'
    )
  _validate_masks(mask, kv_mask, (B, H, S, Skv))


def _validate_masks(
  mask: jax.Array | None,
  kv_mask: jax.Array | None,
  full: tuple[int, int, int, int],
) -> None:
  """Checks the masks against the [B, H, S, Skv] logits shape `full`."""
  B, _, _, Skv = full
  if kv_mask is not None and (
    kv_mask.shape != (B, Skv) or kv_mask.dtype != np.bool_
  ):
    raise ValueError(
      f'kv_mask must be bool [B, S] = {(B, Skv)}, got {kv_mask.dtype} '
      f'{kv_mask.shape}'
    )
  if mask is not None and (
    mask.ndim != 4
    or mask.dtype != np.bool_
    or any(m not in (1, n) for m, n in zip(mask.shape, full, strict=True))
  ):
    raise ValueError(
      f'mask must be bool, rank 4 and broadcastable to [B, H, S, Skv] = '
      f'{full}, got {mask.dtype} {mask.shape}'
    )


def _mask_spec(
  mask: jax.Array, B: int, H: int, axis: AxisName, batch_axis: AxisName | None
) -> P:
  """Shards a [B|1, H|1, S, Skv] mask like the head-sharded logits."""
  batch = batch_axis if mask.shape[0] == B and B > 1 else None
  heads = axis if mask.shape[1] == H and H > 1 else None
  return P(batch, heads, None, None)


def _place(mesh: Mesh, args: list[Any], specs: list[P]) -> list[Any]:
  """Reshards to the shard_map specs, which an Explicit mesh needs up front."""
  if AxisType.Explicit not in mesh.axis_types:
    return args  # Auto axes: shard_map reshards by itself.
  return [
    jax.reshard(x, NamedSharding(mesh, spec))
    for x, spec in zip(args, specs, strict=True)
  ]


def _local_mask(masks: list, has_mask: bool, has_kv_mask: bool):
  """The mask and the key-padding mask of one shard, combined (or None)."""
  local_mask = masks.pop(0) if has_mask else None
  if not has_kv_mask:
    return local_mask
  kv_mask_Bx1x1xS = masks.pop(0)[:, None, None, :]
  if local_mask is None:
    return kv_mask_Bx1x1xS
  return jnp.logical_and(local_mask, kv_mask_Bx1x1xS)


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  mesh: Mesh,
  axis: AxisName,
  causal: bool = False,
  mask: jax.Array | None = None,
  kv_mask: jax.Array | None = None,
  scale: float | None = None,
  attention_fn: AttentionFn | None = None,
  batch_axis: AxisName | None = None,
) -> jax.Array:
  """Multi-head attention with Ulysses sequence parallelism.

  Takes global `[B, S, H, D]` arrays sharded along the sequence over mesh
  axis `axis` (size P) and, if `batch_axis` is given, along the batch over
  that axis. Inside `jax.shard_map`, an all-to-all moves each device's
  `[B, S/P, H, D]` shard to `[B, S, H/P, D]`, `attention_fn` runs over the
  whole sequence for the device's `H/P` heads, and a second all-to-all moves
  the output back to `[B, S/P, H, D]`. Per device, attention activations
  (the `S x S` logits of a non-fused kernel among them) shrink by P.

  Grouped-query attention: `k` and `v` may have `Hkv` heads with `Hkv`
  dividing `H`. When P does not divide `Hkv`, each kv head is repeated
  `r = P // gcd(Hkv, P)` times (`kv_repeat_factor`) before the all-to-all,
  giving `lcm(Hkv, P)` kv heads, which P divides and which divides `H`, so
  each query head still reads its own kv head.

  Requirements (checked before tracing, with the numbers in the error):
  `S % P == 0`, `Skv % P == 0`, `H % P == 0`, `H % Hkv == 0`.

  Examples:
    >>> from jax_superoffload import ulysses
    >>> mesh = jax.make_mesh((4,), ('seq',))  # 4 devices.
    >>> q = jnp.ones((1, 1024, 8, 64))  # [B, S, H, D]
    >>> kv = jnp.ones((1, 1024, 2, 64))  # GQA: 2 kv heads, repeated 2x.
    >>> out = ulysses.attention(q, kv, kv, mesh=mesh, axis='seq', causal=True)

  Args:
    q: queries, `[B, S, H, D]`.
    k: keys, `[B, Skv, Hkv, D]`.
    v: values, `[B, Skv, Hkv, D]`.
    mesh: the device mesh.
    axis: the sequence-parallel mesh axis (or tuple of axes).
    causal: whether query `i` only attends to keys `j <= i`.
    mask: optional bool mask broadcastable to `[B, H, S, Skv]` (each dim
      either full or 1), True where attention is allowed. A full `S x Skv`
      mask is replicated over `axis`, so it costs `S x Skv` per device.
    kv_mask: optional bool padding mask `[B, Skv]`, True for valid keys.
    scale: logit scale; defaults to `1 / sqrt(D)`.
    attention_fn: local attention with the signature of
      `jax.nn.dot_product_attention`, called as `attention_fn(q, k, v,
      mask=..., scale=..., is_causal=...)`. Defaults to that function with
      `implementation=None`, which lets JAX choose the backend (XLA in JAX
      0.10); pass `functools.partial(jax.nn.dot_product_attention,
      implementation='cudnn')` to force cuDNN flash attention on GPU.
    batch_axis: optional mesh axis (or axes) sharding the batch dimension.

  Returns:
    The attention output, `[B, S, H, D]`, sharded like `q`.

  References:
    Jacobs et al., `DeepSpeed Ulysses: System Optimizations for Enabling
    Training of Extreme Long Sequence Transformer Models
    <https://arxiv.org/abs/2309.14509>`_, 2023.
  """
  _validate(q, k, v, mask, kv_mask, mesh, axis, batch_axis)
  B, _, H, _ = q.shape
  Hkv = k.shape[_HEAD_AXIS]
  size = _axis_size(mesh, axis)
  repeats = kv_repeat_factor(Hkv, size)
  if repeats > 1:
    k = jnp.repeat(k, repeats, axis=_HEAD_AXIS)
    v = jnp.repeat(v, repeats, axis=_HEAD_AXIS)
  if attention_fn is None:
    attention_fn = jax.nn.dot_product_attention

  seq_spec = P(batch_axis, axis, None, None)
  args: list[Any] = [q, k, v]
  specs: list[P] = [seq_spec, seq_spec, seq_spec]
  if mask is not None:
    args.append(mask)
    specs.append(_mask_spec(mask, B, H, axis, batch_axis))
  if kv_mask is not None:
    args.append(kv_mask)
    specs.append(P(batch_axis, None))

  def local(q_BxSpxHxD, k_BxSpxKxD, v_BxSpxKxD, *masks):
    q_BxSxHpxD = seq_to_heads(q_BxSpxHxD, axis)
    k_BxSxKpxD = seq_to_heads(k_BxSpxKxD, axis)
    v_BxSxKpxD = seq_to_heads(v_BxSpxKxD, axis)
    local_mask = _local_mask(list(masks), mask is not None, kv_mask is not None)
    out_BxSxHpxD = attention_fn(
      q_BxSxHpxD,
      k_BxSxKpxD,
      v_BxSxKpxD,
      mask=local_mask,
      scale=scale,
      is_causal=causal,
    )
    return heads_to_seq(out_BxSxHpxD, axis)

  return jax.shard_map(
    local, mesh=mesh, in_specs=tuple(specs), out_specs=seq_spec
  )(*_place(mesh, args, specs))
