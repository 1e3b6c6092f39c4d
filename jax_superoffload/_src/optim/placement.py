"""Which buckets stay on the device, and which side casts.

Bucket repartitioning: the buckets whose gradients arrive last in backward
(by default the first leaves in parameter order: the first layers and the
embeddings) have nothing left to overlap their host step with, so their
state can stay on the accelerator and be updated there. Superchip-aware
casting: either up-cast gradients on the device and move fp32 (and move the
fp32 master back, down-casting on the device), or move low precision and
let the kernel convert. Both give bit-identical results.

"auto" asks the planner (`superoffload.plan`), once per parameter tree, in
`init`; the state keeps the choice (`Placement`, a static node of its tree),
so `update` reads it and never plans. It plans for the hardware profile
given to the optimizer, or the one matching the backend: `CPU_ONLY` on CPU and
`GH200` otherwise, for a sequence of 2048 tokens and a batch of 8 (the
planner needs a workload; these are documented guesses, pass `hardware=` or
explicit values to decide otherwise).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax

from jax_superoffload._src.core import backend
from jax_superoffload._src.core import layout

CASTS = ('auto', 'device', 'host')
AUTO_SEQ_LEN = 2048
AUTO_BATCH = 8


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Placement:
  """What `init` chose for one parameter tree; `update` reads it."""

  device_buckets: frozenset[int] = frozenset()  # Their state on the device.
  cast_on_device: bool = False  # Gradients and weights cast on the device.


def decide(
  lay: layout.Layout,
  params: Any,
  *,
  device_buckets: Any,
  arrival_order: Sequence[str] | None,
  cast: str,
  hardware: Any,
) -> Placement:
  """The choices for `params` (laid out as `lay`); "auto" asks the planner."""
  return Placement(
    device_buckets=device_bucket_ids(
      lay, device_buckets, arrival_order, params, hardware
    ),
    cast_on_device=resolve_cast(cast, params, hardware),
  )


def _profile(profile: Any):
  # Imported here, as the planner is: only "auto" choices plan.
  from jax_superoffload._src.planning import hardware as hardware_lib

  if profile is not None:
    return profile
  if backend.target() == 'cpu':
    return hardware_lib.CPU_ONLY
  return hardware_lib.GH200


def _plan(params: Any, profile):
  from jax_superoffload._src.planning import planner

  # The moments the optimizer was built with are not known here; fp32 keeps
  # the choices as they were before the planner chose moments.
  return planner.plan(
    params,
    _profile(profile),
    seq_len=AUTO_SEQ_LEN,
    batch=AUTO_BATCH,
    moments='fp32',
  )


def resolve_cast(cast: str, params: Any, profile) -> bool:
  """True when gradients and weights should be cast on the device."""
  if cast not in CASTS:
    raise ValueError(f'cast must be one of {CASTS}, got {cast!r}')
  if cast == 'auto':
    return _plan(params, profile).cast == 'device'
  return cast == 'device'


def check_device_buckets(device_buckets: Any) -> None:
  """Validates `device_buckets` at construction."""
  if device_buckets == 'auto' or device_buckets is None:
    return
  if isinstance(device_buckets, bool) or not isinstance(
    device_buckets, (int, float)
  ):
    raise TypeError(
      'device_buckets must be an int, a fraction in [0, 1] or "auto", got '
      f'{device_buckets!r}'
    )
  if device_buckets < 0 or (
    isinstance(device_buckets, float) and device_buckets > 1
  ):
    raise ValueError(
      'device_buckets must be a non-negative int or a fraction in [0, 1], '
      f'got {device_buckets!r}'
    )


def device_bucket_ids(
  lay: layout.Layout,
  device_buckets: Any,
  arrival_order: Sequence[str] | None,
  params: Any,
  profile,
) -> frozenset[int]:
  """Indices (in state order) of the buckets kept on the device."""
  total = lay.num_buckets
  if device_buckets is None or total == 0:
    return frozenset()
  if device_buckets == 'auto':
    count = math.ceil(_plan(params, profile).device_bucket_fraction * total)
  elif isinstance(device_buckets, float):
    count = math.ceil(device_buckets * total)
  else:
    count = int(device_buckets)
  count = min(count, total)
  if count == 0:
    return frozenset()
  rank = _arrival_rank(lay, arrival_order)
  # A bucket is complete when its last leaf's gradient arrives.
  done = []
  k = 0
  for group in lay.groups:
    for bucket in group.buckets:
      done.append((max(rank[group.leaves[j]] for j in bucket), k))
      k += 1
  return frozenset(k for _, k in sorted(done)[-count:])


def _arrival_rank(
  lay: layout.Layout, arrival_order: Sequence[str] | None
) -> list[int]:
  """Position of each leaf's gradient in backward (higher = later)."""
  n = len(lay.paths)
  if arrival_order is None:  # Backward visits parameters in reverse.
    return [n - 1 - i for i in range(n)]
  position = {path: r for r, path in enumerate(arrival_order)}
  missing = [p for p in lay.paths if p not in position]
  if missing:
    raise ValueError(
      f'arrival_order does not name {len(missing)} parameters, e.g. '
      f'{missing[:3]}; give every leaf path (jax.tree_util.keystr)'
    )
  return [position[p] for p in lay.paths]
