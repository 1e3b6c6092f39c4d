"""The trainer's compiled programs (train and eval steps) and their placement.

The train step is a pure function of ``nnx.state((model, optimizer))``,
jitted with output shardings equal to its input shardings, so every array
keeps its placement from step to step and the step compiles once.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N803

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_superoffload as superoffload
from experiments.trainer import config as config_lib
from experiments.trainer import model as model_lib
from experiments.trainer import optim

ConfigError = config_lib.ConfigError

# Mesh axes: the batch is sharded over the first, sequences over the second.
DATA_AXIS = 'data'
SEQ_AXIS = 'seq'

# The scalars a train step returns besides the new state.
STEP_METRICS = ('loss', 'grad_norm', 'update_norm', 'param_norm')
# Set to 'held', superoffload's overlap_scan consumes the stacked gradients
# in every scope, as consume_gradients=True asks (docs/gpu.md); restated
# here, as experiments may not import the library's internals.
SCAN_ROWS_ENV = 'JAX_SUPEROFFLOAD_SCAN_ROWS'


def gradients_readable(overlap_scan: bool, consume_gradients: bool) -> bool:
  """Whether the step may read its gradients (for `grad_norm`).

  Not where overlap_scan consumes them: the host steps write the new
  weights over the stacked gradients, and a read is refused when the step
  compiles. Conservative: a stack the scope keeps readable (weight flow,
  a remat policy) costs the metric too.
  """
  held = os.environ.get(SCAN_ROWS_ENV) == 'held'
  return not (overlap_scan and (consume_gradients or held))


TrainStep = Callable[
  [nnx.State, jax.Array, jax.Array], tuple[nnx.State, dict[str, jax.Array]]
]
EvalStep = Callable[[nnx.State, jax.Array, jax.Array], jax.Array]


def global_norm(tree: Any) -> jax.Array:
  """The float32 L2 norm of all leaves of `tree` together."""
  squares = [
    jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)
  ]
  return jnp.sqrt(sum(squares, jnp.float32(0)))


def _applied_gradient(grads: Any, optimizer: nnx.Optimizer) -> Any:
  """The gradient the optimizer applies: this batch's, or the running mean.

  Under `optax.MultiSteps` the inner optimizer sees the mean of the
  micro-batch gradients so far (MultiSteps' own running-mean rule); its norm
  is the one that matters on the micro-step that emits the update.
  """
  grads = nnx.as_pure(grads)
  if not isinstance(optimizer.tx, optax.MultiSteps):
    return grads
  state = nnx.as_pure(optimizer.opt_state)
  count = state.mini_step.astype(jnp.float32) + 1
  return jax.tree.map(
    lambda g, acc: acc + (g.astype(acc.dtype) - acc) / count,
    grads,
    state.acc_grads,
  )


def make_train_step(
  model: model_lib.Transformer,
  optimizer: nnx.Optimizer,
  mesh: Mesh,
  update_norm: bool = False,
  overlap_scan: bool = True,
  consume_gradients: bool = False,
) -> TrainStep:
  """Builds a jitted AdamW step over the state of `model` and `optimizer`.

  Every array keeps its placement (mesh, partition, memory kind), so a
  state restored with the same shardings runs the very same program. The
  state is donated: parameters and optimizer state are updated in place
  (SuperOffload's kernel writes its host buckets where they are), so the
  caller must not use the state it passed in again. Under `optax.MultiSteps`
  one call is one micro-step.

  Args:
    model: The model, placed (and committed) as it should stay.
    optimizer: Its optimizer, likewise.
    mesh: The mesh; the metrics come back replicated over it.
    update_norm: Also return the update's global norm ('update_norm'). It
      keeps every update alive until reduced, so XLA can no longer update
      the weights in place: a parameter-sized temporary.
    overlap_scan: Open `superoffload.overlap_scan` around the gradient and
      the update, so scanned blocks start their host steps in the backward
      pass (superoffload's "stream" executor; a no-op otherwise).
    consume_gradients: With `overlap_scan`, let the host steps write the
      new weights over the stacked gradients (`superoffload.overlap_scan`'s
      option): the step then returns no 'grad_norm'.

  Returns:
    ``step(state, inputs_BxL, targets_BxL)``, which returns the new state
    and the `STEP_METRICS`: the batch loss before the update and the global
    norms of the applied gradient (unless overlap_scan's rows consume it,
    `gradients_readable`) and the new parameters (and of the update, with
    `update_norm`).
  """
  with_grad_norm = gradients_readable(overlap_scan, consume_gradients)
  graphdef, state = nnx.split((model, optimizer))
  shardings = jax.tree.map(lambda x: x.sharding, state)
  scalar = NamedSharding(mesh, P())

  def step(
    state: nnx.State, inputs_BxL: jax.Array, targets_BxL: jax.Array
  ) -> tuple[nnx.State, dict[str, jax.Array]]:
    model, optimizer = nnx.merge(graphdef, state)
    grad_fn = nnx.value_and_grad(model_lib.loss_fn)
    # Scanned blocks start their host steps inside the backward loop
    # (superoffload's "stream" executor; a no-op for other optimizers).
    scope = (
      superoffload.overlap_scan(
        optimizer.tx,
        nnx.as_pure(optimizer.opt_state),
        nnx.as_pure(nnx.state(model, optimizer.wrt)),
        consume_gradients=consume_gradients,
      )
      if overlap_scan
      else contextlib.nullcontext()
    )
    with scope:
      loss, grads = grad_fn(model, inputs_BxL, targets_BxL)
      metrics = {'loss': loss}
      if with_grad_norm:
        metrics['grad_norm'] = global_norm(
          _applied_gradient(model_lib.device_copy(model, grads), optimizer)
        )
      # optimizer.update, keeping weight-flow weights in host memory.
      updates, params = model_lib.apply_gradients(model, optimizer, grads)
    metrics['param_norm'] = global_norm(params)
    if update_norm:
      metrics['update_norm'] = global_norm(updates)
    return nnx.state((model, optimizer)), metrics

  names = [
    m
    for m in STEP_METRICS
    if (update_norm or m != 'update_norm')
    and (with_grad_norm or m != 'grad_norm')
  ]
  metric_shardings = dict.fromkeys(names, scalar)
  return jax.jit(
    step, out_shardings=(shardings, metric_shardings), donate_argnums=0
  )


def config_train_step(
  cfg: config_lib.Config,
  model: model_lib.Transformer,
  optimizer: nnx.Optimizer,
  mesh: Mesh,
) -> TrainStep:
  """`make_train_step` with the step options `cfg` sets."""
  return make_train_step(
    model,
    optimizer,
    mesh,
    update_norm=cfg.update_norm,
    overlap_scan=cfg.overlap_scan,
    consume_gradients=cfg.consume_gradients,
  )


def make_eval_step(
  model: model_lib.Transformer, optimizer: nnx.Optimizer, mesh: Mesh
) -> EvalStep:
  """Builds a jitted ``loss(state, inputs_BxL, targets_BxL)`` (no update).

  It takes the same state as the train step (not donated), so evaluation
  needs no copy of the parameters.
  """
  graphdef, _ = nnx.split((model, optimizer))

  def loss(
    state: nnx.State, inputs_BxL: jax.Array, targets_BxL: jax.Array
  ) -> jax.Array:
    model, _ = nnx.merge(graphdef, state)
    return model_lib.loss_fn(model, inputs_BxL, targets_BxL)

  return jax.jit(loss, out_shardings=NamedSharding(mesh, P()))


def commit_placement(*nodes: nnx.Module | nnx.Optimizer) -> None:
  """Commits every array of `nodes` to the placement it already has.

  Freshly initialized arrays are "uncommitted"; after one jitted step next to
  committed ones (SuperOffload's state is committed to pinned host memory)
  they come back committed, which changes the jit cache key and costs a
  second compilation. Committing them up front keeps it to one.

  Args:
    *nodes: NNX graph nodes (the model, the optimizer), updated in place.
  """
  state = nnx.state(nodes)
  nnx.update(
    nodes, jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
  )


def make_mesh(cfg: config_lib.Config) -> Mesh:
  """The ``('data', 'seq')`` mesh of the first ``mesh_data * mesh_seq`` devices.

  Raises:
    ConfigError: If fewer devices exist.
  """
  need = cfg.mesh_data * cfg.mesh_seq
  devices = jax.devices()  # Every process's, ordered by process.
  if jax.process_count() > 1 and need != len(devices):
    raise ConfigError(
      f'mesh_data x mesh_seq = {cfg.mesh_data} x {cfg.mesh_seq} = {need} '
      f'must span all {len(devices)} devices of the {jax.process_count()} '
      'processes'
    )
  if need > len(devices):
    raise ConfigError(
      f'mesh_data x mesh_seq = {cfg.mesh_data} x {cfg.mesh_seq} = {need} '
      f'devices requested, but only {len(devices)} '
      f'{devices[0].platform} device(s) exist'
    )
  grid = np.array(devices[:need]).reshape(cfg.mesh_data, cfg.mesh_seq)
  return Mesh(grid, (DATA_AXIS, SEQ_AXIS))


def place_on_mesh(mesh: Mesh, *nodes: nnx.Module | nnx.Optimizer) -> None:
  """Commits every array of `nodes` to `mesh`, in the memory it is in.

  Arrays already sharded over `mesh` (e.g. ZeRO-sharded optimizer state)
  keep their sharding; all others are replicated over it. Committing also
  keeps the train step to one compilation (see `commit_placement`).

  Args:
    mesh: The training mesh.
    *nodes: NNX graph nodes (the model, the optimizer), updated in place.
  """

  def place(x: jax.Array) -> jax.Array:
    sharding = x.sharding
    if not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
      sharding = NamedSharding(mesh, P(), memory_kind=sharding.memory_kind)
    return jax.device_put(x, sharding)

  state = nnx.state(nodes)
  nnx.update(nodes, jax.tree.map(place, state))


@dataclasses.dataclass
class Trainable:
  """The model, its optimizer, their compiled steps and their state."""

  model: model_lib.Transformer
  optimizer: nnx.Optimizer
  schedule: Callable[[int], Any]
  train_step: TrainStep
  eval_step: EvalStep
  state: nnx.State
  num_params: int


def build(cfg: config_lib.Config, mesh: Mesh) -> Trainable:
  """Initializes and places the model and optimizer; defines their steps."""
  model = model_lib.init_model(cfg)
  num_params = model_lib.count_params(model)
  if cfg.mesh_seq > 1:
    model_lib.set_sequence_parallel(model, mesh, SEQ_AXIS, DATA_AXIS)
  # Parameters replicated over the mesh before the optimizer state is built
  # from them (ZeRO shards that state over the mesh the parameters are on).
  place_on_mesh(mesh, model)
  schedule = optim.make_schedule(cfg)
  optimizer = nnx.Optimizer(
    model, optim.make_optimizer(cfg, schedule, mesh), wrt=nnx.Param
  )
  # Weight-flow: the stacked block weights move to host memory now that the
  # optimizer has been built from device copies.
  model_lib.offload_weights(model)
  place_on_mesh(mesh, model, optimizer)
  return Trainable(
    model=model,
    optimizer=optimizer,
    schedule=schedule,
    train_step=config_train_step(cfg, model, optimizer, mesh),
    eval_step=make_eval_step(model, optimizer, mesh),
    state=nnx.state((model, optimizer)),
    num_params=num_params,
  )
