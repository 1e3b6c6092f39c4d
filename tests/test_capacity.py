"""The planner's memory against the compiled GPU step, small sizes.

The trainer's scanned step is compiled for an H200 without a GPU
(`experiments.device.aot`) at the harness's small widths, with two and four
layers, for optax.adamw (fp32 parameters) and superoffload's `stream`
executor (bf16 parameters, and fp32 ones). `aot_planner.predict` asks the
planner about the same step, which it must predict within 10%: the host
bytes (the state), the device bytes each layer adds (weights, gradients, the
checkpointed layer input) and the device bytes in all, where the one
layer's activations that the backward pass rebuilds, attention scores
included, are most of the step. The same comparison at the 1B, 8B and
capacity sizes reads the committed compiles (tests/test_planner_compile.py).
Skips without the CUDA plugin wheels, as tests/test_gpu_compile.py does.
"""

import functools
import types

import pytest

from experiments.device import aot
from experiments.device import aot_capacity
from experiments.device import aot_planner
from tests import test_gpu_compile

pytestmark = pytest.mark.aot
ARGS = types.SimpleNamespace(small=True, dtype='bfloat16', preset='1b', batch=2)
SPECS = {s.optimizer + ':' + s.moments: s for s in aot_capacity.SPECS}
# fp32 weights and gradients on the device (8 B/param), fp32 moments.
SPECS['stream32:fp32'] = aot_capacity.Spec('stream, fp32', 'stream', 'float32')
LAYERS = (2, 4)


@pytest.fixture(autouse=True)
def _needs_plugin():
  test_gpu_compile._skip_or_fail()


@functools.cache
def compiled(name: str, layers: int, cast: str = 'host') -> tuple[dict, dict]:
  """The compiled step and the planner's prediction for it."""
  fields = aot_capacity.case_fields(SPECS[name], layers, 'h200', ARGS)
  if cast != 'host':
    fields['overrides'].append(['cast', cast])
  result = aot.run_case(fields, timeout=900)
  assert result['compiles'], result.get('error')
  cfg = aot_planner.trainer_config(fields)
  return result, aot_planner.predict(cfg, result['num_params'], 'h200')


@pytest.mark.parametrize(
  'name, layers',
  [
    ('stream:fp32', 2),
    ('stream:fp32', 4),
    ('stream:8bit', 2),
    ('stream32:fp32', 2),
  ],
)
def test_planner_host_bytes_are_the_compiled_steps(name, layers):
  # Failed before the planner counted the library's state: 16 B/param where
  # the library keeps 12 (8-bit moments: 10 where it keeps 6). The new
  # weights (bf16, cast on the host) come back over their gradients, in
  # device memory, and no weights cross after the join.
  result, predicted = compiled(name, layers)
  host = aot_capacity.memory_bytes(result, 'host_')
  assert result['to_device'] == [], result['to_device']
  assert predicted['host'] == pytest.approx(host, rel=0.1)


@pytest.mark.parametrize('name', ['optax:fp32', 'stream:fp32'])
def test_planner_device_bytes_per_layer_are_the_compiled_steps(name):
  (a, pa), (b, pb) = (compiled(name, n) for n in LAYERS)
  got = aot_capacity.memory_bytes(b) - aot_capacity.memory_bytes(a)
  assert pb['device'] - pa['device'] == pytest.approx(got, rel=0.1)


def test_device_cast_returns_no_weights_through_the_host():
  # Casting on the device, the fp32 weights are copied from the state: the
  # host holds the state alone (a prediction of 4 B/param more failed).
  result, predicted = compiled('stream:fp32', LAYERS[0], cast='device')
  host = aot_capacity.memory_bytes(result, 'host_')
  assert predicted['host'] == pytest.approx(host, rel=0.1)


@pytest.mark.parametrize(
  'name, layers',
  [
    ('optax:fp32', 2),
    ('optax:fp32', 4),
    ('stream:fp32', 2),
    ('stream:fp32', 4),
    ('stream32:fp32', 2),
  ],
)
def test_planner_device_bytes_are_the_compiled_steps(name, layers):
  # Failed before the planner counted the weights' dtype and the scores as
  # jax.nn.dot_product_attention keeps them: 13% under for optax and 20%
  # for `stream` with fp32 weights at two layers (with bf16 weights within
  # 2%, by counting a bucket each way in device memory that the compiled
  # step does not hold).
  result, predicted = compiled(name, layers)
  device = aot_capacity.memory_bytes(result)
  assert predicted['device'] == pytest.approx(device, rel=0.1)
