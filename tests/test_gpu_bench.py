"""The GPU benchmark's helpers, and its dry run end to end on CPU."""

import json
import subprocess
import sys
import time
import types

import pytest

from experiments.benchmarks import gpu_bench
from experiments.sweeps import gpu_analysis

HLO = """\
HloModule jit_step, input_output_alias={ {0}: (0, {}, may-alias) }

%wrapped_copy_computation (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %copy.9 = f32[8,4]{1,0} copy(%p)
}

ENTRY %main.5 (w: f32[8,4], b: bf16[16], n: s32[]) -> (f32[8,4], bf16[16]) {
  %w = f32[8,4]{1,0} parameter(0)
  %b = bf16[16]{0} parameter(1)
  %n = s32[] parameter(2)
  %copy.1 = f32[8,4]{1,0} copy(%w)
  %wrapped_copy = bf16[16]{0} fusion(bf16[16]{0} %b), kind=kLoop, calls=%c
  %add.2 = f32[8,4]{1,0} add(%copy.1, %copy.1)
  %copy.3 = f32[8,4]{1,0} copy(%add.2)
  %constant.4 = s32[] constant(1)
  ROOT %tuple.5 = (f32[8,4]{1,0}, bf16[16]{0}) tuple(%copy.3, %wrapped_copy)
}
"""


def test_parameter_copies_counts_copies_of_entry_parameters_only():
  got = gpu_analysis.parameter_copies(HLO)
  assert got['parameters'] == 3
  assert got['parameter_bytes'] == 8 * 4 * 4 + 16 * 2 + 4
  assert got['copies'] == 2  # copy(%w) and the copy fusion of %b.
  assert got['copied_bytes'] == 8 * 4 * 4 + 16 * 2
  assert [c['parameter'] for c in got['examples']] == [0, 1]


def test_memory_bytes_counts_donated_buffers_once():
  fields = dict(argument=100, output=90, alias=80, temp=7)
  stats = types.SimpleNamespace(
    **{f'{k}_size_in_bytes': v for k, v in fields.items()},
    **{f'host_{k}_size_in_bytes': 2 * v for k, v in fields.items()},
  )
  assert gpu_analysis.memory_bytes(stats) == {'device': 117, 'host': 234}
  assert gpu_analysis.memory_fields(stats)['host_temp_size_in_bytes'] == 14
  assert gpu_analysis.memory_bytes(None) is None


@pytest.mark.parametrize(
  ('measure', 'limit', 'largest', 'exact'),
  [
    (lambda n: 1000 + 100 * n, 5000, 40, True),
    (lambda n: 30e9 + 0.3e9 * n, 134e9, 346, True),  # About a 1B decoder.
    (lambda n: 1000 + 100 * n + n * n, 5000, 30, True),  # Not linear.
    (lambda n: 1000 + 100 * n if n < 3 else 10**9, 5000, 2, True),  # A cliff.
    (lambda n: 1000 + 100 * n, 500, 0, True),  # Nothing fits.
    (lambda n: n, 10**12, None, False),  # Stopped by max_probes.
  ],
)
def test_largest_fitting(measure, limit, largest, exact):
  got = gpu_analysis.largest_fitting(measure, limit, max_probes=8)
  assert got['exact'] == exact
  assert largest is None or got['largest'] == largest
  largest = got['largest']
  assert len(got['probes']) <= 8
  if exact:
    assert measure(largest + 1) > limit
  if largest:
    assert measure(largest) <= limit


def test_largest_fitting_stops_at_the_deadline():
  clock = iter(range(100)).__next__
  got = gpu_analysis.largest_fitting(
    lambda n: n, 10**6, deadline=3, clock=clock
  )
  assert len(got['probes']) == 3 and not got['exact']


@pytest.mark.parametrize(
  ('gib', 'layers', 'width'),
  [(141, 20, 2048), (80, 20, 2048), (16, 7, 2048), (4, 7, 1024)],
)
def test_gpu_sizes_follow_the_device(gib, layers, width):
  sizes = gpu_bench.gpu_sizes(gib * 2**30)
  assert (sizes.model['num_layers'], sizes.model['d_model']) == (layers, width)
  assert sizes.capacity_limit < gib * 2**30


@pytest.mark.dry_run
def test_dry_run_exercises_every_part(tmp_path):
  out = tmp_path / 'gpu_bench.json'
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.benchmarks.gpu_bench',
      '--dry-run',
      '--out',
      str(out),
    ],
    capture_output=True,
    text=True,
    timeout=600,
    check=True,
  )
  report = json.loads(out.read_text())
  assert report['dry_run'] is True, proc.stdout
  results = report['results']
  assert sorted(results) == sorted(
    [f'executors/{e}' for e in gpu_bench.EXECUTORS]
    + [f'{p}/{o}' for p in ('train', 'capacity') for o in gpu_bench.OPTIMIZERS]
  )
  for name, r in results.items():
    assert r['status'] == 'ran', (name, r)
  for e in gpu_bench.EXECUTORS:
    assert results[f'executors/{e}']['match']
  for o in gpu_bench.OPTIMIZERS:
    train = results[f'train/{o}']
    assert train['tokens_per_s'] > 0 and train['memory_bytes']['device'] > 0
    assert train['donated_copies']['parameters'] > 0
    assert results[f'capacity/{o}']['largest'] >= 2
  assert results['train/superoffload']['executor'] == 'ffi'


@pytest.mark.parametrize(
  ('ffi_check', 'case', 'executor'),
  [
    ({'status': 'ran', 'match': True}, 'superoffload', 'auto'),
    ({'status': 'ran', 'match': False}, 'superoffload:xla_host', 'xla_host'),
    ({'status': 'failed rc=-6'}, 'superoffload:xla_host', 'xla_host'),
  ],
)
def test_decoder_parts_fall_back_to_xla_host(ffi_check, case, executor):
  assert gpu_analysis.superoffload_case(ffi_check) == case
  cfg = gpu_bench._decoder_config(gpu_analysis.DRY_SIZES, case)
  assert (cfg.optimizer, cfg.executor) == ('superoffload', executor)


def test_a_failing_case_is_a_finding_and_a_late_one_is_skipped():
  args = types.SimpleNamespace(dry_run=True)
  results = {}
  gpu_bench._run_case(results, 'train', 'nonsense', args, time.time() + 300)
  failed = results['train/nonsense']
  assert failed['status'].startswith('failed rc='), failed
  assert any('nonsense' in line for line in failed['stderr_tail'])
  gpu_bench._run_case(results, 'capacity', 'optax', args, time.time() - 1)
  assert results['capacity/optax']['status'] == 'skipped: budget spent'
