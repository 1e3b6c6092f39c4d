"""MFU against a stated peak, and the held-out eval where a user sees it.

MFU's peak is a datasheet figure (accelerators) or this CPU's matmul peak
recorded once in results/cpu_peak.json: never timed at start-up, and named
in the output. The periodic eval is on the console and in loss_curve.png,
each time with its step.
"""

import contextlib
import io
import json
import pathlib
import types

import jax
import numpy as np
import pytest

from experiments.trainer import cpu_peak
from experiments.trainer import perf
from experiments.trainer import train

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_CORPUS = 'the quick brown fox jumps over the lazy dog. ' * 400
# A made-up CPU peak, far from any real one: MFU must be computed from it.
_PEAK_TFLOPS = 0.0625


def _gpu(kind: str):
  return types.SimpleNamespace(platform='gpu', device_kind=kind)


@pytest.mark.parametrize(
  'kind, dtype, tflops, source',
  [
    ('NVIDIA H100 80GB HBM3', 'bfloat16', 989.0, 'H100 datasheet, SXM'),
    ('NVIDIA H100 80GB HBM3', 'float16', 989.0, 'H100 datasheet, SXM'),
    ('NVIDIA H100 80GB HBM3', 'float32', 494.5, 'dense TF32'),
    ('NVIDIA H200', 'bfloat16', 989.0, 'H200 datasheet'),
    ('NVIDIA GH200 480GB', 'bfloat16', 989.0, 'GH200 datasheet'),
    ('NVIDIA H100 PCIe', 'bfloat16', 756.0, 'PCIe'),
    ('NVIDIA A100-SXM4-80GB', 'float32', 156.0, 'A100 datasheet'),
    ('TPU v5 lite', 'bfloat16', 197.0, 'TPU v5e'),
  ],
)
def test_accelerator_peak_is_the_datasheet_figure_for_the_dtype(
  kind, dtype, tflops, source
):
  peak = perf.peak_flops([_gpu(kind)] * 4, None, dtype)
  assert peak.flops == 4 * tflops * 1e12
  assert source in peak.source and '4 devices' in peak.source


def test_unknown_chip_or_dtype_has_no_peak():
  for kind, dtype in (('Some future chip', 'bfloat16'), ('TPU v4', 'float32')):
    peak = perf.peak_flops([_gpu(kind)], None, dtype)
    assert peak.flops is None and '--config.peak_tflops' in peak.source
  assert perf.peak_flops(jax.devices()[:4], 2.0) == (
    2e12,
    '--config.peak_tflops',
  )


def _record(path: pathlib.Path, tflops: float) -> None:
  entry = {
    'tflops': {'float32': tflops},
    'measured': '2026-12-05 20:00 UTC',
  }
  path.write_text(json.dumps({cpu_peak.cpu_key(): entry}))


def test_cpu_peak_is_read_from_the_results_file(tmp_path):
  path = tmp_path / 'cpu_peak.json'
  tflops, source = cpu_peak.recorded_peak('float32', path)
  assert tflops is None and 'python -m experiments.trainer.cpu_peak' in source
  _record(path, _PEAK_TFLOPS)
  tflops, source = cpu_peak.recorded_peak('float32', path)
  assert tflops == _PEAK_TFLOPS
  assert str(path) in source and cpu_peak.cpu_key() in source
  assert cpu_peak.recorded_peak('bfloat16', path)[0] is None


def test_the_cpu_measurement_is_a_plausible_matmul_rate(monkeypatch):
  monkeypatch.setattr(cpu_peak, 'SIZES', (64,))
  assert 0 < cpu_peak.measure('float32', seconds=0.05) < 100


@pytest.fixture(scope='module')
def metrics_run(tmp_path_factory):
  """A 6-step run evaluating every 4 steps, MFU from a recorded CPU peak."""
  tmp = tmp_path_factory.mktemp('metrics')
  (tmp / 'corpus.txt').write_text(_CORPUS)
  results = tmp / 'cpu_peak.json'
  _record(results, _PEAK_TFLOPS)
  lines = []

  def no_measuring(*args, **kwargs):
    raise AssertionError('the CPU peak was timed at start-up')

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(cpu_peak, 'RESULTS_FILE', results)
    patch.setattr(cpu_peak, 'measure', no_measuring)
    argv = [
      f'--config={_ROOT / "configs" / "tiny.py"}',
      f'--config.data={tmp / "corpus.txt"}',
      f'--config.out_dir={tmp / "run"}',
      '--config.steps=6',
      '--config.eval_every=4',
      '--config.optimizer=optax',
      '--noconfig.progress',
      '--noconfig.tensorboard',
    ]
    cfg = train.config_lib.config_from_args(argv)
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
      summary = train.train(cfg, log=lines.append)
  lines.extend(console.getvalue().splitlines())
  return cfg, summary, lines, tmp / 'run'


def test_mfu_is_against_the_recorded_peak_and_names_it(metrics_run):
  cfg, summary, lines, run = metrics_run
  flops = perf.flops_per_token(
    summary['num_params'], cfg.num_layers, cfg.d_model, cfg.seq_len
  )
  peak = _PEAK_TFLOPS * 1e12
  assert summary['peak_tflops'] == _PEAK_TFLOPS
  assert 'cpu_peak.json' in summary['peak_source']
  assert summary['mfu'] == pytest.approx(
    summary['tokens_per_s'] * flops / peak, rel=1e-12
  )
  records = [json.loads(x) for x in (run / 'metrics.jsonl').open()]
  for r in records:
    assert r['mfu'] == pytest.approx(r['tokens_per_s'] * flops / peak)
  start = lines[0]
  assert 'peak=0.0625 TFLOP/s' in start and 'cpu_peak.json' in start, start
  done = next(x for x in lines if x.startswith('done:'))
  assert f'of {_PEAK_TFLOPS:g} TFLOP/s' in done, done


def test_eval_is_on_the_console_and_in_the_plot_with_its_step(metrics_run):
  _, summary, lines, run = metrics_run
  records = [json.loads(x) for x in (run / 'metrics.jsonl').open()]
  evals = [
    (r['eval_step'], r['eval_loss']) for r in records if 'eval_loss' in r
  ]
  assert [s for s, _ in evals] == [4, 6]  # Every 4 steps and at the end.
  assert summary['eval_step'] == 6
  assert summary['eval_loss'] == evals[-1][1]
  for step, loss in evals:  # The console, as each eval happens.
    assert f'eval {loss:.4f} (' in '\n'.join(lines)
    assert any(f'bpb) at step {step}' in x for x in lines), lines
  done = next(x for x in lines if x.startswith('done:'))
  assert f'eval {evals[-1][1]:.4f}' in done and 'at step 6' in done, done
  from matplotlib import image

  pixels = image.imread(run / 'loss_curve.png')[..., :3]
  orange = np.array([1.0, 0.498, 0.055])  # tab:orange, the eval's colour.
  assert (np.abs(pixels - orange).max(axis=-1) < 0.05).sum() > 20
