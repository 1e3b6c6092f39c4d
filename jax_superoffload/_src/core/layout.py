"""The schedule of kernel calls for a parameter tree, and its checks.

Leaves the kernel covers (float32, bfloat16 and float16 parameters) are
grouped by (parameter dtype, weight decay on/off), so one kernel call per
bucket serves every leaf in it; each group's leaves are taken in order and
split, at leaf boundaries, into buckets of about `bucket_elements` (a leaf
is never split: one larger than that is a bucket of its own). A bucket is
only a schedule: each leaf keeps its own state arrays, shaped like it, and
the kernel reads each gradient and writes each new weight where it
is. Other floating leaves
(float64, complex) go to an optax fallback. The layout is a pure function of
the tree's structure, shapes, dtypes and mask, so `init` and `update` build
the same one without storing it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KERNEL_PARAM_DTYPES = (
  np.dtype(np.float32),
  np.dtype(jnp.bfloat16),
  np.dtype(np.float16),
)


@dataclasses.dataclass(frozen=True)
class Group:
  """Leaves sharing a parameter dtype and a weight-decay flag."""

  dtype: np.dtype
  decay: bool
  leaves: tuple[int, ...]  # Indices into the flattened tree.
  sizes: tuple[int, ...]
  buckets: tuple[tuple[int, ...], ...]  # Positions in `leaves` per bucket.

  @property
  def bucket_sizes(self) -> tuple[int, ...]:
    return tuple(sum(self.sizes[j] for j in b) for b in self.buckets)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a parameter tree maps onto buckets and the fallback."""

  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]
  groups: tuple[Group, ...]
  fallback: tuple[int, ...]  # Leaves updated by the optax fallback.
  fallback_decay: tuple[bool, ...]

  @property
  def bucket_sizes(self) -> tuple[int, ...]:
    return tuple(n for g in self.groups for n in g.bucket_sizes)

  @property
  def num_buckets(self) -> int:
    return len(self.bucket_sizes)


def _path_str(path) -> str:
  return jax.tree_util.keystr(path) or '<root>'


def resolve_mask(mask: Any, tree: Any) -> list[bool]:
  """Per-leaf booleans from an optax-style mask (tree prefix or callable)."""
  leaves = jax.tree.leaves(tree)
  if mask is None:
    return [True] * len(leaves)
  mask_tree = mask(tree) if callable(mask) else mask
  try:
    full = jax.tree.broadcast(mask_tree, tree)
  except ValueError as e:
    raise ValueError(f'mask does not match the parameter tree: {e}') from None
  flags = jax.tree.leaves(full)
  for flag in flags:
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(
        'mask leaves must be Python booleans (the bucket layout is static),'
        f' got {type(flag).__name__}'
      )
  return [bool(f) for f in flags]


def shape_dtype(leaf: Any) -> tuple[tuple[int, ...] | None, np.dtype | None]:
  """The shape and dtype of a parameter, as optax reads them.

  Arrays, tracers and `jax.ShapeDtypeStruct`s by their own; Python and
  NumPy scalars as `jnp.asarray` makes them (a Python float is float32).
  (None, None) for anything else.
  """
  if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
    return tuple(leaf.shape), np.dtype(leaf.dtype)
  if isinstance(leaf, (bool, int, float, complex, np.generic)):
    return (), np.dtype(jnp.result_type(leaf))
  return None, None


def build_layout(
  tree: Any, decay: Sequence[bool], *, bucket_elements: int, use_kernel: bool
) -> Layout:
  """Assigns each leaf of `tree` to a bucket group or to the fallback."""
  leaves_with_paths, treedef = jax.tree.flatten_with_path(tree)
  paths = tuple(_path_str(p) for p, _ in leaves_with_paths)
  shapes, dtypes = [], []
  for path, (_, leaf) in zip(paths, leaves_with_paths, strict=True):
    shape, dtype = shape_dtype(leaf)
    if shape is None:
      raise TypeError(f'parameter {path} is not an array: {type(leaf)}')
    if not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
        f'parameter {path} has dtype {dtype}{list(leaf.shape)}; Adam needs '
        'floating-point parameters (exclude integer leaves, e.g. with '
        'optax.multi_transform or nnx.Optimizer(wrt=nnx.Param))'
      )
    shapes.append(shape)
    dtypes.append(dtype)
  members: dict[tuple[np.dtype, bool], list[int]] = {}
  fallback = []
  for i, dtype in enumerate(dtypes):
    if use_kernel and dtype in KERNEL_PARAM_DTYPES:
      members.setdefault((dtype, bool(decay[i])), []).append(i)
    else:
      fallback.append(i)
  groups = []
  for (dtype, group_decay), idx in sorted(
    members.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])
  ):
    sizes = tuple(int(np.prod(shapes[i], dtype=np.int64)) for i in idx)
    groups.append(
      Group(
        dtype,
        group_decay,
        tuple(idx),
        sizes,
        _split(sizes, bucket_elements),
      )
    )
  return Layout(
    treedef,
    paths,
    tuple(shapes),
    tuple(dtypes),
    tuple(groups),
    tuple(fallback),
    tuple(bool(decay[i]) for i in fallback),
  )


def _split(sizes: Sequence[int], target: int) -> tuple[tuple[int, ...], ...]:
  """Greedy buckets of whole leaves, each up to `target` elements."""
  buckets, current, filled = [], [], 0
  for j, size in enumerate(sizes):
    if current and filled > 0 and filled + size > target:
      buckets.append(tuple(current))
      current, filled = [], 0
    current.append(j)
    filled += size
  if filled > 0:
    buckets.append(tuple(current))
  elif current and buckets:  # Trailing zero-size leaves join the last one.
    buckets[-1] += tuple(current)
  return tuple(buckets)


def check_tree(layout: Layout, tree: Any, what: str) -> list[Any]:
  """Flattens `tree` against the layout, naming any mismatching leaf."""
  leaves_with_paths, treedef = jax.tree.flatten_with_path(tree)
  if treedef != layout.treedef:
    got = {_path_str(p) for p, _ in leaves_with_paths}
    want = set(layout.paths)
    missing = sorted(want - got)[:3]
    extra = sorted(got - want)[:3]
    raise ValueError(
      f"{what} do not have the parameters' tree structure: missing "
      f'{missing or "none"}, unexpected {extra or "none"}; got {treedef}, '
      f'expected {layout.treedef}'
    )
  leaves = [leaf for _, leaf in leaves_with_paths]
  for path, leaf, shape in zip(
    layout.paths, leaves, layout.shapes, strict=True
  ):
    if tuple(np.shape(leaf)) != shape:
      raise ValueError(
        f'{what} leaf {path} has shape {tuple(np.shape(leaf))}, the '
        f'parameter has shape {shape}'
      )
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      raise TypeError(
        f'{what} leaf {path} has non-floating dtype {jnp.result_type(leaf)}'
      )
  # Python and NumPy scalars as the arrays optax's math makes of them.
  return [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
