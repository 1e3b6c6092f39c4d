"""Tests for experiments.sweeps.sweep and experiments.sweeps.analyze."""

import json
import pathlib
import sys

import pytest

from experiments.sweeps import analyze
from experiments.sweeps import sweep
from experiments.sweeps import sweep_report

_REPO = pathlib.Path(__file__).resolve().parents[1]

_CONFIG = """
name = 'unit'
results = 'out/unit.jsonl'
runs_dir = 'runs'
steps = 4
timeout_s = 60
flags = {batch_size = 2, warmup_steps = 1, scan_layers = false}

[grid]
seq_len = [16, 32]
weights_policy = ['stationary']

[[grid.optimizer]]
name = 'superoffload'

[[grid.optimizer]]
name = 'optax'

[[grid.optimizer]]
name = 'so-xla'
optimizer = 'superoffload'
executor = 'xla_host'
flags = ['--clip-norm=1.0']

[[grid.model]]
name = 'a'
preset = 'tiny'

[[grid.model]]
name = 'b'
preset = 'tiny'
flags = {d_model = 64, num_layers = 2}
"""


def _write_config(tmp_path, text=_CONFIG, suffix='.toml'):
  path = tmp_path / f'unit{suffix}'
  path.write_text(text)
  return sweep.load_config(path)


def _flag(argv, name):
  prefix = f'--{name}='
  return next(a[len(prefix) :] for a in argv if a.startswith(prefix))


class FakeTrainer:
  """Writes what the trainer would; fails or skips files on request."""

  def __init__(self, root, fail=(), summary_json=True):
    self.root = pathlib.Path(root)
    self.fail = fail
    self.summary_json = summary_json
    self.calls = []

  def __call__(self, argv, timeout_s, cwd):
    self.calls.append(list(argv))
    optimizer = _flag(argv, 'optimizer')
    if optimizer in self.fail:
      return sweep.ProcessResult(
        1, '', 'Traceback ...\nValueError: boom for the test\n', False, 0.1
      )
    out = pathlib.Path(cwd) / _flag(argv, 'out-dir')
    out.mkdir(parents=True, exist_ok=True)
    seq_len = int(_flag(argv, 'seq-len'))
    cfg = {
      'preset': 'tiny',
      'optimizer': optimizer,
      'executor': 'auto',
      'batch_size': 2,
      'seq_len': seq_len,
      'final_loss_window': 2,
    }
    (out / 'config.json').write_text(json.dumps(cfg))
    times = [5.0, 0.1, 0.3, 0.2] if optimizer == 'optax' else [5.0, 0.1, 0.2]
    with open(out / 'metrics.jsonl', 'w') as f:
      for step, t in enumerate(times):
        row = {'step': step, 'loss': 5.0 - step, 'step_time_s': t}
        f.write(json.dumps(row) + '\n')
    if self.summary_json:
      summary = {
        'optimizer': optimizer,
        'num_params': 1234,
        'mfu': 0.5,
        'tokens_per_s': 99.0,
        'step_time_s_median': 0.15,
        'host_bytes_per_param': 12.0,
        'device_bytes_per_param': 4.0,
        'wall_time_s': 1.5,
      }
      (out / 'summary.json').write_text(json.dumps(summary))
    # What a real trainer prints; the sweep must not need to parse it.
    stdout = 'preset=tiny params=9,999 corpus=...\ndone: ... | 7.5s | x\n'
    return sweep.ProcessResult(0, stdout, '', False, 0.2)


def test_grid_expansion_and_run_ids(tmp_path):
  cfg = _write_config(tmp_path)
  assert len(cfg.runs) == 2 * 2 * 3
  ids = [r.run_id for r in cfg.runs]
  assert len(set(ids)) == len(ids)
  # Optimizers vary fastest; ids are readable slugs plus a hash.
  assert [r.grid['optimizer_name'] for r in cfg.runs[:3]] == [
    'superoffload',
    'optax',
    'so-xla',
  ]
  assert ids[0].startswith('a-superoffload-s16-stationary-')
  spec = next(r for r in cfg.runs if r.grid['model'] == 'b')
  assert '--d-model=64' in spec.flags and '--no-scan-layers' in spec.flags
  xla = next(r for r in cfg.runs if r.grid['optimizer_name'] == 'so-xla')
  assert '--executor=xla_host' in xla.flags
  assert '--clip-norm=1.0' in xla.flags
  assert xla.flags[-1] == '--steps=4'
  # Stable across loads; a changed flag changes the id.
  assert [r.run_id for r in _write_config(tmp_path).runs] == ids
  changed = _write_config(tmp_path, _CONFIG.replace('steps = 4', 'steps = 5'))
  assert changed.runs[0].run_id != ids[0]
  # JSON configs have the same structure.
  raw = {
    'steps': 3,
    'grid': {
      'optimizer': ['optax'],
      'model': [{'name': 'm', 'preset': 'tiny'}],
    },
  }
  cfg_json = _write_config(tmp_path, json.dumps(raw), '.json')
  assert len(cfg_json.runs) == 1
  assert cfg_json.runs[0].run_id.startswith('m-optax-')


def test_repeats_make_passes(tmp_path):
  cfg = _write_config(tmp_path, _CONFIG.replace('steps = 4', 'repeats = 2'))
  assert len(cfg.runs) == 2 * 12
  assert [r.grid['repeat'] for r in cfg.runs] == [0] * 12 + [1] * 12
  assert cfg.runs[0].flags == cfg.runs[12].flags
  assert cfg.runs[0].run_id.startswith('a-superoffload-s16-stationary-r0-')
  assert len({r.run_id for r in cfg.runs}) == 24


def test_sweep_records_failures_and_resumes(tmp_path):
  cfg = _write_config(tmp_path)
  fake = FakeTrainer(tmp_path, fail=('optax',))
  sw = sweep.Sweep(cfg, root=tmp_path, runner=fake, log=lambda _: None)
  records = sw.run()
  assert len(fake.calls) == len(cfg.runs) == len(records)
  lines = sweep.read_jsonl(tmp_path / 'out' / 'unit.jsonl')
  assert [r['run_id'] for r in lines] == [r.run_id for r in cfg.runs]
  failed = [r for r in lines if r['status'] == 'failed']
  assert len(failed) == 4
  assert all('ValueError: boom for the test' in r['error'] for r in failed)
  assert all(r['summary'] is None for r in failed)
  ok = [r for r in lines if r['status'] == 'ok']
  assert len(ok) == 8
  first = ok[0]
  assert first['summary_source'] == 'summary.json'
  summary = first['summary']
  assert set(sweep.SUMMARY_KEYS) <= set(summary)
  # The trainer's summary.json as written, not its stdout.
  assert summary['num_params'] == 1234
  assert summary['wall_time_s'] == 1.5
  assert summary['tokens_per_s'] == 99.0
  assert summary['host_bytes_per_param'] == 12.0
  assert summary['device_bytes_per_param'] == 4.0
  assert summary['final_loss'] is None  # Keys it lacks are null.
  assert first['step_times']['timed_steps'] == 2
  assert first['step_times']['step_time_s_median'] == pytest.approx(0.15)
  assert first['argv'][-2:] == [
    f'--out-dir=runs/{first["run_id"]}',
    '--no-progress',
  ]

  # Re-running skips the ok runs and retries the failed ones.
  fake2 = FakeTrainer(tmp_path)
  sw2 = sweep.Sweep(cfg, root=tmp_path, runner=fake2, log=lambda _: None)
  assert len(sw2.pending()) == 4
  sw2.run()
  assert len(fake2.calls) == 4
  assert all(_flag(c, 'optimizer') == 'optax' for c in fake2.calls)
  lines = sweep.read_jsonl(tmp_path / 'out' / 'unit.jsonl')
  assert len(lines) == 16  # The failures stay in the file.
  latest = sweep_report.load_runs([tmp_path / 'out' / 'unit.jsonl'])
  assert len(latest) == 12 and all(r['status'] == 'ok' for r in latest)
  # Nothing left to do.
  sw3 = sweep.Sweep(cfg, root=tmp_path, runner=fake2, log=lambda _: None)
  assert sw3.run() == []


def test_no_retry_skips_failed(tmp_path):
  cfg = _write_config(tmp_path)
  sweep.Sweep(
    cfg, root=tmp_path, runner=FakeTrainer(tmp_path, fail=('superoffload',))
  ).run()
  fake = FakeTrainer(tmp_path)
  sw = sweep.Sweep(cfg, root=tmp_path, runner=fake, log=lambda _: None)
  assert sw.run(retry=False) == []
  assert sw.run(only='optax') == []  # Those were ok already.
  assert len(sw.run(only='a-superoffload')) == 2  # Retried.
  assert len(sw.pending()) == 6  # so-xla and b-superoffload still failed.


def test_run_without_summary_json_fails(tmp_path):
  cfg = _write_config(tmp_path)
  fake = FakeTrainer(tmp_path, summary_json=False)
  sw = sweep.Sweep(cfg, root=tmp_path, runner=fake, log=lambda _: None)
  record = sw.run_one(cfg.runs[0])
  assert record['status'] == 'failed'
  assert 'wrote no summary.json' in record['error']
  assert record['summary'] is None
  assert fake.calls == [fake.calls[0]]  # No second (probe) process.


def test_timeout_is_recorded(tmp_path):
  cfg = _write_config(tmp_path)
  script = (
    'import sys, time; print("started", file=sys.stderr, flush=True); '
    'time.sleep(60)'
  )
  cfg = sweep.SweepConfig(
    name='t',
    description='',
    results=pathlib.Path('t.jsonl'),
    runs_dir=pathlib.Path('runs'),
    steps=1,
    timeout_s=1.0,
    runs=cfg.runs[:1],
    trainer=(sys.executable, '-c', script),
  )
  record = sweep.Sweep(cfg, root=tmp_path, log=lambda _: None).run()[0]
  assert record['status'] == 'timeout'
  assert record['returncode'] is None
  assert 'timed out after 1 s' in record['error']
  assert 'started' in record['error']
  assert record['subprocess_wall_s'] < 15


def test_crash_without_stderr_and_no_metrics(tmp_path):
  cfg = _write_config(tmp_path)
  for code, expected in (
    ('raise SystemExit(3)', 'exit status 3'),
    ('', 'wrote no summary.json'),
  ):
    c = sweep.SweepConfig(
      name='c',
      description='',
      results=pathlib.Path('c.jsonl'),
      runs_dir=pathlib.Path('runs'),
      steps=1,
      timeout_s=30,
      runs=cfg.runs[:1],
      trainer=(sys.executable, '-c', code),
    )
    record = sweep.Sweep(c, root=tmp_path, log=lambda _: None).run_one(
      c.runs[0]
    )
    assert record['status'] == 'failed'
    assert expected in record['error']


def test_real_tiny_run(tmp_path):
  """One real trainer subprocess: the tiny preset for 3 steps."""
  text = f"""
results = '{tmp_path}/real.jsonl'
runs_dir = '{tmp_path}/runs'
steps = 3
timeout_s = 120
flags = {{warmup_steps = 1, data_max_bytes = 50000}}
[grid]
optimizer = ['superoffload']
[[grid.model]]
name = 'tiny'
preset = 'tiny'
"""
  cfg = _write_config(tmp_path, text)
  sw = sweep.Sweep(cfg, root=_REPO, log=lambda _: None)
  record = sw.run()[0]
  assert record['status'] == 'ok', record['error']
  summary = record['summary']
  assert summary['optimizer'] == 'superoffload'
  assert summary['steps'] == 3
  assert summary['num_params'] > 10_000
  assert summary['step_time_s_median'] > 0
  # The trainer's own count: fp32 master, mu and nu on the host.
  assert summary['host_bytes_per_param'] == pytest.approx(12.0, abs=0.1)
  assert summary['device_bytes_per_param'] == pytest.approx(4.0, abs=0.1)


def _synthetic_jsonl(path):
  records = []
  for model, params in (('s', 1_000_000), ('m', 4_000_000)):
    for opt, ms in (('superoffload', 10.0), ('optax', 12.0), ('device', 20.0)):
      status = 'failed' if (model, opt) == ('m', 'device') else 'ok'
      summary = None
      if status == 'ok':
        step = ms * params / 1e6 / 1e3
        summary = {
          'num_params': params,
          'step_time_s_median': step,
          'tokens_per_s': 32 / step,
          'host_bytes_per_param': 0.0 if opt == 'optax' else 12.0,
          'device_bytes_per_param': 12.0 if opt == 'optax' else 4.0,
          'first_loss': 5.5,
          'final_loss': 5.0,
          'optimizer': opt,
        }
      records.append(
        {
          'run_id': f'{model}-{opt}',
          'grid': {
            'model': model,
            'optimizer_name': opt,
            'seq_len': 32,
            'weights_policy': 'stationary',
          },
          'status': status,
          'error': 'Traceback\nRuntimeError: out of memory'
          if summary is None
          else None,
          'summary': summary,
          'summary_source': 'metrics.jsonl',
          'started_at': '2026-12-02T00:00:00+00:00',
        }
      )
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))


def test_analyze_tables_and_plots(tmp_path):
  jsonl = tmp_path / 'sweep.jsonl'
  _synthetic_jsonl(jsonl)
  out = tmp_path / 'out'
  tables = analyze.analyze([jsonl], _REPO / 'results', out).read_text()
  assert 'superoffload at least as fast as optax in 2 setting(s)' in tables
  assert (
    '| s | 1,000,000 | 32 | stationary | 10.0 | 12.0 | 20.0 | 1.20x | yes |'
    in (tables)
  )
  assert 'RuntimeError: out of memory' in tables
  assert '| m | 4,000,000 | 32 | stationary | superoffload | ok | 40.0 |' in (
    tables
  )
  expected = ['sweep_throughput.png', 'sweep_bytes_per_param.png']
  for name in ('bench_adam', 'bench_step', 'paper_predictions'):
    if (_REPO / 'results' / f'{name}.json').exists():
      expected.append(f'{name}.png')
      assert f'![{name}]({name}.png)' in tables
  for name in expected:
    assert (out / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n', name


def test_analyze_aggregates_repeats(tmp_path):
  jsonl = tmp_path / 'sweep.jsonl'
  _synthetic_jsonl(jsonl)
  records = [json.loads(x) for x in jsonl.read_text().splitlines()]
  extra = []
  for r in records:  # A second pass: superoffload slower than optax at 's'.
    r2 = json.loads(json.dumps(r))
    r2['run_id'] += '-r1'
    r['grid']['repeat'], r2['grid']['repeat'] = 0, 1
    if r2['summary'] and r2['run_id'] == 's-superoffload-r1':
      r2['summary']['step_time_s_median'] = 0.014
    extra.append(r2)
  lines = [json.dumps(r) + '\n' for r in records + extra]
  jsonl.write_text(''.join(lines))
  rows = sweep_report.run_rows(sweep_report.load_runs([jsonl]))
  table, wins = sweep_report.comparison_table(rows)
  # Median of 10 and 14 ms is 12 ms: level with optax, once in two passes.
  assert '| s | 1,000,000 | 32 | stationary | 12.0 | 12.0 | 20.0 | 1.00x |' in (
    table
  )
  assert '| yes | 1/2 |' in table and wins == 2
  agg = {(r['model'], r['optimizer']): r for r in sweep_report.aggregate(rows)}
  assert agg['s', 'superoffload']['step_ms_max'] == pytest.approx(14.0)
  assert agg['m', 'device']['status'] == 'failed'
  assert agg['m', 'device']['runs'] == 2


def test_analyze_without_benchmarks(tmp_path):
  jsonl = tmp_path / 'sweep.jsonl'
  _synthetic_jsonl(jsonl)
  tables = analyze.analyze([jsonl], tmp_path / 'nothing', tmp_path / 'o')
  text = tables.read_text()
  assert 'bench_adam.json` not found' in text
  assert (tmp_path / 'o' / 'sweep_throughput.png').exists()


def test_real_two_process_entry(tmp_path, monkeypatch):
  """A grid point asking for 2 processes runs them under jax.distributed."""
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=1')
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  text = f"""
results = '{tmp_path}/procs.jsonl'
runs_dir = '{tmp_path}/runs'
steps = 3
timeout_s = 180
flags = ['--warmup-steps=1', '--data-max-bytes=50000', '--mesh-data=2',
         '--peak-tflops=1', '--no-tensorboard']
[grid]
optimizer = ['superoffload']
processes = [2]
[[grid.model]]
name = 'tiny'
preset = 'tiny'
"""
  cfg = _write_config(tmp_path, text)
  (spec,) = cfg.runs
  assert spec.processes == 2 and '-p2-' in spec.run_id
  sw = sweep.Sweep(cfg, root=_REPO, log=lambda _: None)
  record = sw.run()[0]
  assert record['status'] == 'ok', record['error']
  assert record['grid']['processes'] == 2
  assert record['summary']['steps'] == 3
  # One metrics line per step: process 0 alone wrote the run folder.
  metrics = (tmp_path / 'runs' / spec.run_id / 'metrics.jsonl').read_text()
  assert len(metrics.splitlines()) == 3
