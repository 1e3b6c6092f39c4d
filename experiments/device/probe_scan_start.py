"""Probe: can a stream start run inside a scan's backward loop?

  python -m experiments.device.probe_scan_start   # deviceless, H200 target

Compiles, for an H200 without a GPU, a toy step shaped like the design that
results/gpu_design_history_2026-12.md records: a `custom_vjp` around each
layer's slice of a scanned weight stack, whose backward rule starts the host
step of the layer's row (`jax_superoffload_adam_step_row`,
xla_ffi/row_ffi.h) on the layer's gradient, the loop's counter and the
stacked fp32 state in pinned host memory (master, mu and nu, f32[L, n] each,
stepped in place); after the loop a stream join aliases the state. It prints
the calls, the loops' tuples and `memory_analysis()`, and checks what the
design needs:

- each host stack reaches the backward loop once, not stacked per layer as
  a residual, and uncopied (no host temporaries);
- the in-loop call is the row step, on the loop's host stacks;
- the join aliases the entry parameters themselves, so the host step's
  writes land where the join reads.

The in-loop call is the one `adam_step_row` (jax_superoffload/_src/host/
grace_adam.py) emits with the stream executor's placement (operands other
than the state flattened on the device); experiments may not import the
library's private modules, so `_row_start` spells it out, and
tests/test_row_step.py checks that it lowers to the binding's call.
"""

from __future__ import annotations

import sys

import numpy as np

from experiments.device import deviceless

LAYERS, WIDTH = 4, 1 << 16
ROW_TARGET = 'jax_superoffload_adam_step_row'
# BucketAttrs (xla_ffi/ffi_support.h) of a one-leaf row step; the staging
# bound is what the start stages: the count, the scalars, the row and the
# row's f32 gradient, each 256-byte aligned.
ROW_ATTRS = {
  'nesterov': False,
  'keep_nonfinite': False,
  'compute_sumsq': False,
  'num_leaves': np.int64(1),
  'reseed': False,
  'quantized': False,
  'staging_bytes': np.int64(3 * 256 + 4 * WIDTH),
  'prefetch': 't0',
  'host_threads': np.int64(0),
  'hold_inputs': False,
  'weights_over_grads': False,
}


def _row_start(state, g_i, i, hyper) -> None:
  """The row step of layer `i` (adam_step_row with a StreamPlace)."""
  import jax
  import jax.numpy as jnp

  operands = [
    jnp.asarray(hyper.count, jnp.int32).reshape(-1),
    hyper.packed().reshape(-1),
    jnp.asarray(i, jnp.int32).reshape(1).reshape(-1),
    *state,
    g_i.reshape(-1),
  ]
  call = jax.ffi.ffi_call(ROW_TARGET, (), has_side_effect=True)
  call(*operands, **ROW_ATTRS)


def _step(join_target: str, hyper):
  import jax
  import jax.numpy as jnp

  @jax.custom_vjp
  def hook(w_i, i, state):
    del i, state
    return w_i

  def hook_fwd(w_i, i, state):
    # The host state is a primal input, not a closure: a custom_vjp rule
    # may not close over the jit's tracers.
    return w_i, (i, state)

  def hook_bwd(res, g_i):
    i, state = res
    _row_start(state, g_i, i, hyper)
    return g_i, None, None

  hook.defvjp(hook_fwd, hook_bwd)

  def step(w, master, mu, nu, x):
    state = (master, mu, nu)

    def loss(w):
      def body(c, inputs):
        w_i, i = inputs
        return jnp.tanh(c * hook(w_i, i, state)), None

      rows = jnp.arange(LAYERS, dtype=jnp.int32)
      c, _ = jax.lax.scan(body, x, (w, rows))
      return c.sum()

    g = jax.grad(loss)(w)
    join = jax.ffi.ffi_call(
      join_target,
      [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in state],
      input_output_aliases={0: 0, 1: 1, 2: 2},
      has_side_effect=True,
    )
    state = join(*state, g.sum().astype(jnp.int32))
    host = [jax.device_put(s, jax.memory.Space.Host) for s in state]
    return w - 0.1 * g, *host

  return step


def _operands(line: str) -> list[str]:
  """The operand names of an HLO instruction's line."""
  inside = line.split('(', 1)[1].split(')')[0]
  return [o.split('*/')[-1].strip() for o in inside.split(', ')]


def _checks(compiled) -> dict[str, bool]:
  """What the design needs, read from the compiled program."""
  host_stack = f'f32[{LAYERS},{WIDTH}]{{1,0:S(5)}}'
  lines = compiled.hlo.splitlines()
  defs = {x.split(' = ')[0].split()[-1]: x for x in lines if ' = ' in x}
  backward = 'transpose(jvp())/while'
  loop = next(x for x in lines if ' while(' in x and backward in x)
  join = next(x for x in lines if 'jax_superoffload_stream_join' in x)
  row = [x for x in lines if f'custom_call_target="{ROW_TARGET}"' in x]
  entry = {n for n, x in defs.items() if ' parameter(' in x}
  row_ops = _operands(row[0].split('custom-call', 1)[1]) if row else []
  return {
    'each host stack enters the backward loop once': (
      loop.count(host_stack) == 3
    ),
    'no host temporaries': compiled.memory['host_temp_size_in_bytes'] == 0,
    'no copy of a host stack': not any(
      f'{host_stack} copy' in x for x in lines
    ),
    'one row step, in the backward loop, on its host stacks as they are': (
      len(row) == 1
      and f'{backward}/body' in row[0]
      and all(
        f'{host_stack} get-tuple-element(%arg_tuple' in defs[o]
        for o in row_ops[3:6]
      )
    ),
    'the row is computed in the loop': (
      len(row_ops) == 7 and f'{backward}/body' in defs[row_ops[2]]
    ),
    'the join aliases the entry parameters': set(
      _operands(join.split('custom-call', 1)[1])[:3]
    )
    <= entry,
  }


def main() -> int:
  deviceless.add_plugin_path()
  import jax
  import jax.numpy as jnp

  import jax_superoffload as superoffload
  from experiments.device import hlo_report

  cpu = jax.devices('cpu')[0]
  host = jax.sharding.SingleDeviceSharding(cpu, memory_kind='pinned_host')
  device = jax.sharding.SingleDeviceSharding(cpu, memory_kind='device')
  stack = (LAYERS, WIDTH)
  args = (
    jax.ShapeDtypeStruct(stack, jnp.float32, sharding=device),
    *(jax.ShapeDtypeStruct(stack, jnp.float32, sharding=host),) * 3,
    jax.ShapeDtypeStruct((WIDTH,), jnp.float32, sharding=device),
  )
  hyper = superoffload.kernels.Hyperparams(count=3, learning_rate=1e-3)
  with superoffload.compiling_for('gpu'):
    # Choosing the stream executor files its targets for CUDA.
    superoffload.adamw(1e-3, offload=superoffload.Offload(executor='stream'))
    step = _step(hlo_report.JOIN_TARGET, hyper)
    compiled = deviceless.compile_for_gpu(
      step,
      args,
      deviceless.topology('h200', 1),
      jit_kwargs=dict(
        donate_argnums=(1, 2, 3), out_shardings=(device, host, host, host)
      ),
    )
  for line in compiled.hlo.splitlines():
    if 'jax_superoffload_' in line or ' while(' in line:
      print(line.strip()[:240])
  print('memory:', compiled.memory)
  checks = _checks(compiled)
  for name, ok in checks.items():
    print(f'{"ok" if ok else "FAILED"}: {name}')
  return 0 if all(checks.values()) else 1


if __name__ == '__main__':
  sys.exit(main())
