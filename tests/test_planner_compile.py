"""The planner against every committed compile of the trainer's step.

`python -m experiments.device.aot_planner AOT_JSON` puts `superoffload.plan`
beside each case the deviceless harness compiled for a GPU: two and four
layers of the harness's small width, the 1B preset, the 8B config
(configs/llama8b.py) and the capacity search's compiles at the 1B width
(16 and 64 layers, and the edges from 91 to 584 layers). Where the case is
the program the planner models, its device and host bytes must be within
10% of XLA's; where it is not, `outside_model` must say why. Reads the
JSONs under results/ and compiles nothing (tests/test_capacity.py compiles
the small sizes again where the CUDA plugin wheels are).
"""

import pathlib

import pytest

from experiments.device import aot_planner

_ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPILES = (
  'results/gpu_aot/1b_h200_held_2026-12-07.json',
  'results/gpu_aot/8b_h100_held_plugin0.12.0.1_2026-12-07.json',
  'results/gpu_aot/8b_h100_held_jax0.12.1_2026-12-07.json',
  'results/gpu_aot/small_h200_2026-12-07.json',
  'results/gpu_aot/1b_h200_default_2026-12-07.json',
  'results/gpu_aot/1b_h200_rows_reseed_2026-12-07.json',
  'results/gpu_aot/8b_h100_plugin0.12.0.1_2026-12-07.json',
  'results/gpu_aot/8b_h100_jax0.12.1_2026-12-07.json',
  'results/aot_capacity.json',
)
# Shapes where the planner is not within 10%, compiled to say how far.
OTHER_SHAPES = 'results/gpu_aot/planner_other_shapes_2026-12-07.json'


def _compared(path: str) -> list[dict]:
  return [
    aot_planner.compare(r) for r in aot_planner.compiled_cases(_ROOT / path)
  ]


@pytest.mark.parametrize('path', COMPILES, ids=lambda p: p.split('/')[-1])
def test_the_planner_is_within_10_percent_of_what_it_models(path):
  # Failed before the planner knew the weights' dtype and counted the
  # scores as jax.nn.dot_product_attention keeps them: the 1B stream step
  # with fp32 weights 43% under, the capacity search's 16 layers 25% under,
  # two small layers 13% (optax) and 20% (stream, fp32 weights) under.
  compared = [c for c in _compared(path) if not c['outside']]
  assert compared
  for c in compared:
    assert abs(c['device_error']) <= 0.1, c
    assert abs(c['host_error']) <= 0.1 if c['host'] else not c['planner_host']


def test_each_compile_outside_the_model_says_why():
  outside = {
    c['label'] + ' ' + c['jax']: c['outside']
    for path in COMPILES
    for c in _compared(path)
    if c['outside']
  }
  words = {
    'optax:scan:bfloat16 0.12.0.1': 'no fp32 master',
    'auto=ffi:scan:float32 0.12.0.1': 'host compute',
    'device:scan:float32 0.12.0.1': 'copies the state',
    'auto=stream:scan:bfloat16 0.12.1': 'overlap_scan',
    'auto=stream:scan:bfloat16:after-loop 0.12.1': 'in device memory',
  }
  for case, word in words.items():
    assert word in outside[case], (case, outside[case])


def test_the_shapes_outside_10_percent_are_the_documented_ones():
  # cost_model's docstring names them, with why: few layers of a wide
  # model, where the rebuilt layer's packing (7 to 14 B a score in XLA,
  # 12 in the planner) is most of the step, and widths where the scores
  # are not most of a layer (few heads, short sequences), where XLA keeps
  # more per token than the planner's 34 sbh.
  errors = {
    c['label']: c['device_error']
    for c in _compared(OTHER_SHAPES)
    if not c['outside']
  }
  outside = {k: e for k, e in errors.items() if abs(e) > 0.1}
  assert set(outside) == set(LIMITS), outside
  for key, error in outside.items():
    assert error == pytest.approx(LIMITS[key], abs=0.005), key


# Each shape's case and the planner's device error there.
LIMITS = {
  'optax:scan:float32 x2 256/4/512 512x2 on h200': 0.21,
  'optax:scan:float32:after-loop x2 2048/16/8192 2048x4 on h200': 0.163,
  'stream:scan:bfloat16:after-loop x2 4096/32/18432 2048x1 on h200': 0.14,
  'stream:scan:bfloat16:after-loop x2 256/2/1024 256x4 on h200': -0.192,
  'stream:scan:bfloat16:after-loop x4 256/2/1024 256x4 on h200': -0.11,
}
