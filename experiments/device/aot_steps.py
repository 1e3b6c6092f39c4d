"""The trainer's train step, built abstractly for a deviceless GPU compile.

No array is allocated: the model and optimizer are shapes
(`nnx.eval_shape`), their placement is what the trainer's own init program
compiles to on CPU devices (memory kinds and ZeRO shardings included), and
the step is the trainer's `make_train_step`, traced inside
`superoffload.compiling_for('gpu')` so the library builds the GPU program.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_superoffload as superoffload
from experiments.trainer import config as config_lib
from experiments.trainer import model as model_lib
from experiments.trainer import optim
from experiments.trainer import steps as steps_lib

# The optimizers a case names: optax's adamw, or superoffload's executors;
# "auto" is the library's default, resolved as on a GPU when the case is
# compiled (`superoffload.resolve_executor`).
OPTIMIZERS = ('optax', 'auto', 'stream', 'ffi', 'xla_host', 'device')
LAYOUTS = ('scan', 'noscan')


@dataclasses.dataclass(frozen=True)
class Case:
  """One train step to compile: the trainer's config, and the target."""

  optimizer: str = 'auto'  # One of OPTIMIZERS.
  layout: str = 'scan'  # 'scan' (lax.scan over layers) or 'noscan'.
  param_dtype: str = 'float32'
  moments: str = 'fp32'  # 'fp32', 'bf16' or '8bit' (superoffload only).
  preset: str = '1b'
  layers: int | None = None  # None: the preset's.
  batch: int = 4
  devices: int = 1  # >1: data parallel, ZeRO for superoffload's state.
  gpu: str = 'h200'
  # The trainer's overlap_scan (scanned blocks start their host steps in
  # the backward loop); False compiles the step that starts them after it.
  overlap_scan: bool = True
  # Further trainer config fields, e.g. (('d_model', 256),) for small tests.
  overrides: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f'optimizer must be one of {OPTIMIZERS}')
    if self.layout not in LAYOUTS:
      raise ValueError(f'layout must be one of {LAYOUTS}')

  @property
  def name(self) -> str:
    """A short label: optimizer:layout:dtype[:moments][:zeroN][:after-loop]."""
    parts = [self.optimizer, self.layout, self.param_dtype]
    if self.moments != 'fp32':
      parts.append(self.moments)
    if self.devices > 1:
      parts.append(f'zero{self.devices}')
    if not self.overlap_scan:
      parts.append('after-loop')
    return ':'.join(parts)


def trainer_config(case: Case) -> config_lib.Config:
  """The trainer's config for `case`."""
  optimizer = {'optax': 'optax', 'device': 'device'}.get(
    case.optimizer, 'superoffload'
  )
  fields = dict(
    batch_size=case.batch,
    scan_layers=case.layout == 'scan',
    param_dtype=case.param_dtype,
    optimizer=optimizer,
    executor=case.optimizer if optimizer == 'superoffload' else 'auto',
    moments=case.moments,
    mesh_data=case.devices,
    zero=case.devices > 1 and optimizer != 'optax',
    progress=False,
    overlap_scan=case.overlap_scan,
    **dict(case.overrides),
  )
  if case.layers is not None:
    fields['num_layers'] = case.layers
  return config_lib.get_config(case.preset, **fields)


def placed_state(mesh: Mesh, make: Any) -> Any:
  """The state's abstract arrays, placed as the trainer's init places them.

  The init program is compiled for the CPU devices of `mesh` (not run):
  its output shardings carry each leaf's memory kind and, under ZeRO, its
  shard. Leaves it leaves on one device are replicated over the mesh, as
  `steps.place_on_mesh` does: as `NamedSharding`s, the only shardings
  whose memory kind a `jax.ShapeDtypeStruct` carries into a jit's types (a
  `SingleDeviceSharding`'s pinned_host is typed as device memory, and the
  optimizer refuses its state there).
  """
  init = jax.jit(lambda: nnx.state(make()))
  shardings = init.lower().compile().output_shardings
  shapes = jax.eval_shape(lambda: nnx.state(make()))

  def place(shape: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    if not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
      sharding = NamedSharding(mesh, P(), memory_kind=sharding.memory_kind)
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)

  return jax.tree.map(place, shapes, shardings)


@dataclasses.dataclass(frozen=True)
class Built:
  """A traced-ready train step, its arguments, and what it holds."""

  step: Any  # The trainer's jitted step.
  args: tuple[Any, ...]  # (state, inputs, targets) as ShapeDtypeStructs.
  num_params: int
  state_bytes: dict[str, int]  # Optimizer-state bytes by memory kind.


def _state_bytes(opt_state: Any) -> dict[str, int]:
  totals: dict[str, int] = {}
  for x in jax.tree.leaves(opt_state):
    kind = x.sharding.memory_kind or 'device'
    size = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    totals[kind] = totals.get(kind, 0) + size // _shard_count(x)
  return totals


def _shard_count(x: jax.ShapeDtypeStruct) -> int:
  spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
  mesh = x.sharding.mesh
  count = 1
  for axes in spec:
    for axis in (axes,) if isinstance(axes, str) else axes or ():
      count *= mesh.shape[axis]
  return count


def build(case: Case) -> Built:
  """The trainer's step for `case` on CPU devices, built as for a GPU.

  Trace and compile it inside `superoffload.compiling_for('gpu')` too: the
  library makes its backend-dependent choices when the step is traced.
  """
  cfg = trainer_config(case)
  mesh = steps_lib.make_mesh(cfg)
  with superoffload.compiling_for('gpu'):

    def make() -> tuple[model_lib.Transformer, nnx.Optimizer]:
      model = model_lib.init_model(cfg)
      schedule = optim.make_schedule(cfg)
      tx = optim.make_optimizer(cfg, schedule, mesh)
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      model_lib.offload_weights(model)
      return model, optimizer

    model, optimizer = nnx.eval_shape(make)
    state = placed_state(mesh, make)
    nnx.update((model, optimizer), state)
    step = steps_lib.config_train_step(cfg, model, optimizer, mesh)
  tokens = jax.ShapeDtypeStruct(
    (cfg.batch_size, cfg.seq_len),
    jnp.int32,
    sharding=NamedSharding(mesh, P(steps_lib.DATA_AXIS)),
  )
  return Built(
    step=step,
    args=(state, tokens, tokens),
    num_params=model_lib.count_params(model),
    state_bytes=_state_bytes(nnx.state(optimizer)),
  )
