"""What the trainer measures and logs: eval split, norms, TensorBoard events,
profiler traces, gradient accumulation, schedules, and non-finite runs."""

import itertools
import json
import math
import pathlib
import struct

import numpy as np
import pytest

from experiments.trainer import checkpointing
from experiments.trainer import config
from experiments.trainer import optim
from experiments.trainer import train

_CORPUS = 'the quick brown fox jumps over the lazy dog. ' * 400


def _args(tmp_path, *flags, optimizer='superoffload', steps=10):
  data = tmp_path / 'corpus.txt'
  data.write_text(_CORPUS)
  return [
    '--preset=tiny',
    f'--optimizer={optimizer}',
    f'--data={data}',
    f'--out-dir={tmp_path / "run"}',
    f'--steps={steps}',
    '--no-progress',
    '--peak-tflops=1',
    '--update-norm',
    *flags,
  ]


def _strict_records(run_dir: pathlib.Path) -> list[dict]:
  """Parses metrics.jsonl line by line, refusing NaN and Infinity."""

  def refuse(name):
    raise ValueError(f'not JSON: {name}')

  lines = (run_dir / 'metrics.jsonl').read_text().splitlines()
  return [json.loads(line, parse_constant=refuse) for line in lines]


def _train(argv):
  return train.train(config.config_from_args(argv), log=lambda _: None)


@pytest.fixture(scope='module')
def measured_run(tmp_path_factory):
  """10 steps with evaluation every 5 and a profiler window over steps 2-3."""
  tmp = tmp_path_factory.mktemp('measured')
  argv = _args(tmp, '--eval-every=5', '--profile-steps=2:4')
  return _train(argv), tmp / 'run'


def test_eval_loss_and_bits_per_byte(measured_run):
  summary, run_dir = measured_run
  records = _strict_records(run_dir)
  evals = [r for r in records if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [4, 9]  # After 5 and 10 steps.
  for r in evals:
    assert r['eval_bpb'] == pytest.approx(r['eval_loss'] / math.log(2))
  assert evals[1]['eval_loss'] < evals[0]['eval_loss']
  assert summary['eval_loss'] == evals[1]['eval_loss']
  assert summary['eval_bpb'] == evals[1]['eval_bpb']


def test_norms_and_learning_rate_every_step(measured_run):
  _, run_dir = measured_run
  records = _strict_records(run_dir)
  assert len(records) == 10
  for r in records:
    for key in ('grad_norm', 'update_norm', 'param_norm'):
      assert r[key] >= 0 and math.isfinite(r[key]), (key, r)
    assert r['grad_norm'] > 0 and r['param_norm'] > 0
  # Warmup from 0: the first step moves nothing, the next ones do.
  assert records[0]['lr'] == 0 and records[0]['update_norm'] == 0
  assert all(r['lr'] > 0 and r['update_norm'] > 0 for r in records[1:])
  # The parameters change by the update: |p1| <= |p0| + |update|.
  assert records[2]['param_norm'] <= (
    records[1]['param_norm'] + records[2]['update_norm'] + 1e-5
  )


def _scalar_events(event_file: pathlib.Path) -> dict[str, list[int]]:
  """Tag -> steps of the scalar summaries in a TensorBoard event file."""
  from tensorboardX.proto import event_pb2

  data = event_file.read_bytes()
  tags: dict[str, list[int]] = {}
  offset = 0
  while offset < len(data):  # TFRecord: length, crc, payload, crc.
    (length,) = struct.unpack('<Q', data[offset : offset + 8])
    payload = data[offset + 12 : offset + 12 + length]
    offset += 12 + length + 4
    event = event_pb2.Event.FromString(payload)
    for value in event.summary.value:
      tags.setdefault(value.tag, []).append(event.step)
  return tags


def test_tensorboard_event_files_beside_metrics(measured_run):
  _, run_dir = measured_run
  (event_file,) = run_dir.glob('events.out.tfevents.*')
  tags = _scalar_events(event_file)
  for tag in (
    'train/loss',
    'train/lr',
    'train/grad_norm',
    'train/update_norm',
    'train/param_norm',
  ):
    assert tags[tag] == list(range(10)), tag
  assert tags['eval/loss'] == [4, 9]
  assert tags['eval/bpb'] == [4, 9]


def test_profiler_trace_written(measured_run):
  _, run_dir = measured_run
  traces = list((run_dir / 'profile').rglob('*.xplane.pb'))
  assert traces and traces[0].stat().st_size > 0


@pytest.mark.parametrize('optimizer', ['superoffload', 'optax'])
def test_grad_accum_equals_the_larger_batch(tmp_path, optimizer):
  (tmp_path / 'a').mkdir()
  (tmp_path / 'b').mkdir()
  accum = _train(
    _args(
      tmp_path / 'a',
      '--batch-size=2',
      '--grad-accum=3',
      optimizer=optimizer,
      steps=6,
    )
  )
  large = _train(
    _args(tmp_path / 'b', '--batch-size=6', optimizer=optimizer, steps=6)
  )
  got = _strict_records(pathlib.Path(accum['out_dir']))
  want = _strict_records(pathlib.Path(large['out_dir']))
  assert accum['total_tokens'] == large['total_tokens']
  for key in ('loss', 'grad_norm', 'update_norm', 'param_norm'):
    np.testing.assert_allclose(
      [r[key] for r in got], [r[key] for r in want], rtol=2e-5, err_msg=key
    )


def test_optax_honours_clip_norm(tmp_path):
  runs = {}
  for name, optimizer, clip in (
    ('optax', 'optax', '--clip-norm=0.05'),
    ('superoffload', 'superoffload', '--clip-norm=0.05'),
    ('unclipped', 'optax', '--clip-norm=none'),
  ):
    (tmp_path / name).mkdir()
    summary = _train(_args(tmp_path / name, clip, optimizer=optimizer, steps=5))
    runs[name] = [
      r['loss'] for r in _strict_records(pathlib.Path(summary['out_dir']))
    ]
  # Clipped optax equals SuperOffload's clipping (speculation-then-
  # validation), and differs from no clipping.
  np.testing.assert_allclose(runs['optax'], runs['superoffload'], atol=1e-5)
  assert abs(runs['optax'][-1] - runs['unclipped'][-1]) > 1e-3


@pytest.mark.parametrize('schedule', config.SCHEDULES)
def test_schedules(schedule):
  cfg = config.get_config(
    'tiny',
    schedule=schedule,
    steps=100,
    warmup_steps=10,
    learning_rate=1.0,
    min_lr_ratio=0.1,
    decay_fraction=0.2,
  )
  lr = [float(optim.make_schedule(cfg)(s)) for s in range(101)]
  assert lr[0] == 0 and lr[5] == pytest.approx(0.5) and lr[10] == 1.0
  assert all(b <= a + 1e-7 for a, b in itertools.pairwise(lr[10:]))
  end = {'cosine': 0.1, 'linear': 0.1, 'constant': 1.0, 'wsd': 0.1}[schedule]
  assert lr[100] == pytest.approx(end)
  if schedule == 'wsd':  # Stable until the last 20% of the steps.
    assert lr[80] == 1.0 and lr[90] == pytest.approx(0.55)
  if schedule == 'linear':
    assert lr[55] == pytest.approx(0.55)


def _diverging(tmp_path, *flags):
  """A run whose learning rate (1e30) blows up the parameters at step 1."""
  return _args(
    tmp_path,
    '--learning-rate=1e30',
    '--schedule=constant',
    '--warmup-steps=2',  # Step 0 has lr 0: one good step to checkpoint.
    '--checkpoint-every=1',
    *flags,
    steps=6,
  )


def test_nonfinite_run_stops_and_keeps_its_last_good_checkpoint(
  tmp_path, capsys
):
  assert train.main(_diverging(tmp_path)) == train.NONFINITE_EXIT
  err = capsys.readouterr().err
  assert err.startswith('error: step 1: non-finite') and err.count('\n') == 1
  records = _strict_records(tmp_path / 'run')
  assert [r['step'] for r in records] == [0, 1]
  assert records[1]['param_norm'] is None  # Inf, written as null.
  ckpt = checkpointing.RunCheckpointer(tmp_path / 'run' / 'checkpoints')
  assert ckpt.all_steps() == [1]


def test_nonfinite_run_goes_on_when_asked_and_logs_strict_json(tmp_path):
  assert train.main(_diverging(tmp_path, '--on-nonfinite=continue')) == 0
  records = _strict_records(tmp_path / 'run')
  assert [r['step'] for r in records] == list(range(6))
  assert any(r['loss'] is None for r in records)


def test_update_norm_is_opt_in(tmp_path):
  # Reducing every update keeps them all alive, which costs the in-place
  # weight update a parameter-sized temporary: it is logged only on request.
  argv = [a for a in _args(tmp_path, steps=2) if a != '--update-norm']
  _train(argv)
  records = _strict_records(tmp_path / 'run')
  assert records and all('update_norm' not in r for r in records)
  assert all(r['grad_norm'] > 0 and r['param_norm'] > 0 for r in records)
