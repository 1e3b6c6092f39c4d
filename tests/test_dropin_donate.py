"""A donated step after an Orbax restore, whatever the restore target.

JAX types an array that Orbax restores from its target's sharding, and
only a `NamedSharding` carries the memory kind into the type: into a
`SingleDeviceSharding` in pinned host memory, the restored array lives on
the host but is typed as device memory. A jit given no out_shardings pairs
donated inputs with outputs by shape and dtype alone, so a step that
returned such a leaf in device memory (or a device leaf in host memory)
aliased buffers of two memory kinds, and PJRT aborted the process:
"PjRtBuffer's memory kind does not match sharding's memory kind".

Each case runs in a child process, so that an abort fails one test and
not the suite. The judge is the uninterrupted run, bit for bit.
"""

import subprocess
import sys
import textwrap

import pytest

_CHILD = """
import sys, tempfile
import jax, jax.numpy as jnp, numpy as np, optax
import orbax.checkpoint as ocp
import jax_superoffload as superoffload

target_kind, executor = sys.argv[1], sys.argv[2]
params0 = jax.device_put(
  {'b': jnp.linspace(-1.0, 1.0, 5), 'w': jnp.linspace(0.5, 2.0, 12)
   .reshape(3, 4)}, jax.devices()[0])
kw = {'executor': 'ffi', 'clip_norm': 1.0, 'skip_nonfinite': True}
tx = superoffload.adamw(1e-2, weight_decay=0.1, **(kw if executor == 'stv'
                                                   else {}))

def stepper(donate):
  def step(p, s, x):
    g = jax.grad(lambda p: sum(jnp.sum((v * x) ** 2) for v in
                               jax.tree.leaves(p)))(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return jax.jit(step, donate_argnums=(0, 1) if donate else ())

def run(p, s, steps, donate):
  step = stepper(donate)
  for i in steps:
    p, s = step(p, s, 1.0 + 0.25 * i)
  return p, s

want, _ = run(params0, tx.init(params0), range(5), False)
p, s = run(params0, tx.init(params0), range(3), False)
path = tempfile.mkdtemp() + '/ckpt'
with ocp.StandardCheckpointer() as checkpointer:
  checkpointer.save(path, {'p': p, 's': s})
  checkpointer.wait_until_finished()
  fresh = {'p': params0, 's': tx.init(params0)}
  target = {
    'fresh': lambda: fresh,
    'trained': lambda: jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                    {'p': p, 's': s}),
    'jit_init': lambda: {'p': params0, 's': jax.jit(tx.init)(params0)},
    'eval_shape': lambda: jax.eval_shape(
      lambda: {'p': params0, 's': tx.init(params0)}),
  }[target_kind]()
  restored = checkpointer.restore(path, target)
if sys.argv[3:] == ['placed']:  # As the refusal below says to.
  restored['s'] = jax.device_put(
    restored['s'], superoffload.state_shardings(tx, restored['p']))
got, state = run(jax.tree.map(jnp.copy, restored['p']), restored['s'],
                 range(3, 5), True)
for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
  np.testing.assert_array_equal(a, b)
spaces = {str(jax.typeof(x).memory_space) for x in jax.tree.leaves(state)
          if x.ndim > 0}
print('same', *sorted(spaces))
"""


def _child(
  target: str, executor: str, *extra: str
) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, '-c', textwrap.dedent(_CHILD), target, executor, *extra],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )


@pytest.mark.parametrize('executor', ['plain', 'stv'])
@pytest.mark.parametrize('target', ['fresh', 'trained'])
def test_restored_into_a_target_with_shardings_steps_donated_on_the_host(
  target, executor
):
  # The fresh state's shardings, or a trained state's: its host leaves
  # come back typed as host memory and stay there.
  child = _child(target, executor)
  assert child.returncode == 0, child.stderr[-3000:]
  assert child.stdout.split()[-2:] == ['same', 'MemorySpace.Host']


@pytest.mark.parametrize('executor', ['plain', 'stv'])
@pytest.mark.parametrize('target', ['eval_shape', 'jit_init'])
def test_restored_into_device_memory_is_refused_then_placed(target, executor):
  # jax.eval_shape of `init` (as nnx.eval_shape builds a target) has no
  # shardings, and a jitted init's leave the mesh out of the host leaves'
  # types: Orbax restores them typed as device memory. The donated step
  # refuses them with the fix (no abort, no silent device state), and
  # placed with state_shardings they step on the host as the run did.
  child = _child(target, executor)
  assert child.returncode == 1, child.stderr[-3000:]
  assert 'came in device memory' in child.stderr
  assert 'superoffload.state_shardings(tx, params)' in child.stderr
  placed = _child(target, executor, 'placed')
  assert placed.returncode == 0, placed.stderr[-3000:]
  assert placed.stdout.split()[-2:] == ['same', 'MemorySpace.Host']
