"""The step model: calibrated on the one GPU run, and what a start holds.

The calibration reads the committed compile of 2026-12-07 (no compile
here) and checks the model against what the H200 printed on 2026-12-04.
The model's other cases are written by hand, their times worked out from
the rates in predict_step.
"""

import pathlib

import pytest

from experiments.device import aot_table
from experiments.device import predict_step

RESULTS = pathlib.Path(__file__).resolve().parents[1] / 'results' / 'gpu_aot'
CALIBRATION = RESULTS / '1b_h200_calibration_2026-12-07.json'
BEFORE_FACTS = RESULTS / '1b_h200_default_2026-12-07.json'


def _rows(path: pathlib.Path) -> list[dict]:
  return predict_step.load(path)


def test_the_calibration_reproduces_the_h200_run_within_its_tolerance():
  # optax's 1B step, the ffi optimizer-only step and the ffi train step
  # against optax's, as measured on 2026-12-04, from the compiled ffi
  # program's own copies and waits.
  got = {
    r['measurement']: r for r in predict_step.calibrate(_rows(CALIBRATION))
  }
  assert set(got) == set(predict_step.MEASURED)
  for name, row in got.items():
    assert abs(row['predicted'] / row['measured'] - 1) <= 0.25, (name, row)
    assert row['within']


def test_the_calibration_tells_a_wrong_host_to_host_rate(monkeypatch):
  # Host compute's own copies of `b * 2` (34 GiB/s, the same profile
  # file) in place of the staging copies' rate: the model misses the run.
  monkeypatch.setattr(predict_step, 'H2H_BYTES_PER_S', 34 * 2**30)
  got = predict_step.calibrate(_rows(CALIBRATION))
  assert not all(r['within'] for r in got)


def test_the_ffi_step_waits_on_the_compute_stream_for_every_copy():
  # Read from the compiled program, not assumed: the one host-compute
  # call's copies, each waited for by the compute stream.
  case = predict_step._find(_rows(CALIBRATION), 'ffi')
  (call,) = case['optimizer_calls']
  assert call['target'] == 'HostExecute'
  copies = call['copies_in'] + call['copies_out']
  assert {c['waited_by'] for c in copies} == {'compute'}
  by_direction = {}
  for c in copies:
    by_direction[c['direction']] = (
      by_direction.get(c['direction'], 0) + c['bytes']
    )
  assert by_direction == {d: case['copies'][d]['bytes'] for d in ('D2H', 'H2H')}
  assert call['device_result_bytes'] > 0  # The new weights, by its done.


def _start_case(hold: bool, share: float, aliased: bool = True) -> dict:
  """One start of 1e8 parameters staging 0.4 GB, joined at the end."""
  start = {
    'name': 's',
    'target': 'jax_superoffload_adam_step_segments',
    'backward_flops_before': share,
    'hold_inputs': hold,
    'weights_alias_grads': aliased,
    'weights_bytes': 400_000_000 if aliased else 0,
  }
  join = {
    'name': 'j',
    'target': predict_step.JOIN,
    'waits': True,
    'backward_flops_before': 1.0,
  }
  return {
    'case': 'hand',
    'num_params': 100_000_000,
    'stream_staging': [{'name': 's', 'staged': 400_000_000}],
    'optimizer_calls': [start, join],
    'to_device': [],
  }


def test_a_start_that_holds_its_inputs_leaves_the_compute_stream_alone():
  fb = predict_step.optax_step_s(4) - predict_step.OPTAX_UPDATE_S
  held = predict_step.predict_case(_start_case(hold=True, share=0.5), 4)
  # Its copy, host step and weights' copy back end inside the backward.
  assert held['compute_stream_waits_s'] == 0
  assert held['step_s'] == pytest.approx(fb, abs=1e-4)
  waited = predict_step.predict_case(_start_case(hold=False, share=0.5), 4)
  copy_s = 400_000_000 / predict_step.D2H_BYTES_PER_S
  assert waited['compute_stream_waits_s'] == pytest.approx(copy_s, abs=1e-4)


def test_a_row_its_worker_fetches_costs_the_compute_stream_its_scalars_only():
  # A row step of stacked gradients stages 768 bytes of scalars at its
  # start, which the compute stream waits for, and its worker fetches the
  # 0.4 GB row itself: the compute stream never waits for that copy.
  case = _start_case(hold=False, share=0.5, aliased=False)
  case['stream_staging'][0].update(staged=400_000_768, fetched=400_000_000)
  got = predict_step.predict_case(case, 4)
  scalars_s = 768 / predict_step.D2H_BYTES_PER_S
  assert got['compute_stream_waits_s'] == pytest.approx(scalars_s, abs=1e-6)
  assert got['D2H_GB'] == pytest.approx(0.4, abs=1e-6)


def test_only_the_last_buckets_host_step_and_copy_back_are_exposed():
  # A start when the backward ends: its copy to the host, its host step
  # and its weights' copy back follow the backward, nothing else does.
  fb = predict_step.optax_step_s(4) - predict_step.OPTAX_UPDATE_S
  last = predict_step.predict_case(_start_case(hold=True, share=1.0), 4)
  exposed = (
    400_000_000 / predict_step.D2H_BYTES_PER_S
    + 100_000_000 / predict_step.HOST_ADAM_PARAMS_PER_S
    + 400_000_000 / predict_step.H2D_BYTES_PER_S
  )
  assert last['step_s'] == pytest.approx(fb + exposed, abs=1e-4)


def test_a_json_without_the_new_fields_is_todays_design():
  # Compiled before hlo_report recorded them: every start waited for, the
  # weights copied after the join; host compute has no per-call copies.
  rows = _rows(BEFORE_FACTS)
  stream = predict_step._find(rows, 'stream')
  assert 'hold_inputs' not in stream['optimizer_calls'][3]
  got = predict_step.predict_case(stream, 4)
  assert got['step_s'] == pytest.approx(0.3765, abs=1e-3)
  assert got['compute_stream_waits_s'] > 0.1
  assert predict_step.predict_case(predict_step._find(rows, 'ffi'), 4) is None


def test_the_harness_table_prints_each_compiled_cases_prediction():
  lines = aot_table.table(_rows(CALIBRATION)).splitlines()
  predicted = [line for line in lines if ' predicted: ' in line]
  cases = [
    r['case']
    for r in _rows(CALIBRATION)
    if predict_step.executor(r) in ('stream', 'ffi')
  ]
  assert [line.split()[0] for line in predicted] == cases
  assert all('batch 4 ' in line and 'batch 8 ' in line for line in predicted)
