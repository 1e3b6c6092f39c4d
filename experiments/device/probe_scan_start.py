"""Probe for issue 37 point 1: can a start run inside a scan's backward loop?

  python -m experiments.device.probe_scan_start   # deviceless, H200 target

Compiles, for an H200 without a GPU, a toy step shaped like the design in
docs/gpu.md: a `custom_vjp` around each layer's slice of a scanned weight
stack, whose backward rule makes a side-effecting call (standing in for a
start) on the layer's gradient, the loop's counter and a stacked host
buffer (standing in for the host state); after the loop a stream join
aliases that host buffer. It prints the calls, the loops' tuples and
`memory_analysis()`, and checks what the design needs:

- the host buffer reaches the backward loop once, not stacked per layer as
  a residual, and uncopied (no host temporaries);
- the join aliases the entry parameter itself, so the host step's writes
  land where the join reads.

Any CUDA-registered target compiles; the probe's in-loop call uses the
to-device copy's name and is never run.
"""

from __future__ import annotations

import sys

from experiments.device import deviceless

LAYERS, WIDTH = 4, 1 << 16


def _step(start_target: str, join_target: str):
  import jax
  import jax.numpy as jnp

  @jax.custom_vjp
  def hook(w_i, i, host):
    del i, host
    return w_i

  def hook_fwd(w_i, i, host):
    # The host buffer is a primal input, not a closure: a custom_vjp rule
    # may not close over the jit's tracers.
    return w_i, (i, host)

  def hook_bwd(res, g_i):
    i, host = res
    jax.ffi.ffi_call(start_target, (), has_side_effect=True)(g_i, host, i)
    return g_i, None, None

  hook.defvjp(hook_fwd, hook_bwd)

  def step(w, host, x):
    def loss(w):
      def body(c, inputs):
        w_i, i = inputs
        return jnp.tanh(c * hook(w_i, i, host)), None

      rows = jnp.arange(LAYERS, dtype=jnp.int32)
      c, _ = jax.lax.scan(body, x, (w, rows))
      return c.sum()

    g = jax.grad(loss)(w)
    join = jax.ffi.ffi_call(
      join_target,
      (jax.ShapeDtypeStruct(host.shape, host.dtype),),
      input_output_aliases={0: 0},
      has_side_effect=True,
    )
    (host,) = join(host, g.sum().astype(jnp.int32))
    return w - 0.1 * g, jax.device_put(host, jax.memory.Space.Host)

  return step


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
    jax.ShapeDtypeStruct(stack, jnp.float32, sharding=host),
    jax.ShapeDtypeStruct((WIDTH,), jnp.float32, sharding=device),
  )
  with superoffload.compiling_for('gpu'):
    # Choosing the stream executor files its targets for CUDA.
    superoffload.adamw(1e-3, offload=superoffload.Offload(executor='stream'))
    step = _step(hlo_report.TO_DEVICE_TARGET, hlo_report.JOIN_TARGET)
    compiled = deviceless.compile_for_gpu(
      step,
      args,
      deviceless.topology('h200', 1),
      jit_kwargs=dict(donate_argnums=(1,), out_shardings=(device, host)),
    )
  host_stack = f'f32[{LAYERS},{WIDTH}]{{1,0:S(5)}}'
  lines = compiled.hlo.splitlines()
  for line in lines:
    if 'jax_superoffload_' in line or ' while(' in line:
      print(line.strip()[:240])
  print('memory:', compiled.memory)
  loop = next(
    x for x in lines if ' while(' in x and 'transpose(jvp())/while' in x
  )
  join = next(x for x in lines if 'jax_superoffload_stream_join' in x)
  checks = {
    'the host stack enters the backward loop once': loop.count(host_stack) == 1,
    'no host temporaries': compiled.memory['host_temp_size_in_bytes'] == 0,
    'no copy of the host stack': not any(
      f'{host_stack} copy' in x for x in lines
    ),
    'the join aliases the entry parameter': 'custom-call(%host' in join,
  }
  for name, ok in checks.items():
    print(f'{"ok" if ok else "FAILED"}: {name}')
  return 0 if all(checks.values()) else 1


if __name__ == '__main__':
  sys.exit(main())
