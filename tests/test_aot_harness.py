"""The deviceless harness's command line, without compiling anything.

`python -m experiments.device.aot` (and `make gpu-compile AOT_ARGS=...`):
its `auto` optimizer, its model-shape and GPU flags, and the capacity
search's compile cache. Compiles are replaced by a fake here, so these run
on every JAX line; tests/test_gpu_compile.py compiles the same flags.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import jax_superoffload as superoffload
from experiments.device import aot
from experiments.device import aot_capacity
from experiments.device import aot_steps

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cases(flags: str) -> list[dict]:
  return aot.cases(aot.parse_args(flags.split()))


def _config(fields: dict):
  case = aot_steps.Case(
    **{**fields, 'overrides': tuple(map(tuple, fields['overrides']))}
  )
  return aot_steps.trainer_config(case)


# (a) auto: what a plain superoffload.adamw(...) resolves to on a GPU.


def test_the_default_optimizers_compile_auto_beside_optax():
  optimizers = aot.parse_args([]).optimizers.split(',')
  assert optimizers[:2] == ['optax', 'auto']
  assert aot_steps.Case().optimizer == 'auto'


def test_auto_is_the_trainers_default_executor_resolved_on_a_gpu():
  (fields,) = _cases('--optimizers auto --layouts scan')
  cfg = _config(fields)
  assert (cfg.optimizer, cfg.executor) == ('superoffload', 'auto')
  case = aot_steps.Case(optimizer='auto')
  with superoffload.compiling_for('gpu'):
    resolved = aot.resolved_executor(case)
    assert resolved['executor'] == superoffload.resolve_executor('auto')
  assert resolved['executor'] == 'stream'  # Its CUDA handlers file here.
  assert resolved['case'] == f'auto={resolved["executor"]}:scan:float32'


def test_every_optimizer_the_harness_names_passes_the_trainers_checks():
  # The trainer's own CLI takes each of them (--config.executor=stream).
  names = ','.join(aot_steps.OPTIMIZERS)
  assert len(_cases(f'--optimizers {names} --layouts scan')) == 6


def test_an_unknown_optimizer_is_refused_by_the_parser(capsys):
  with pytest.raises(SystemExit):
    aot.parse_args(['--optimizers', 'optax,adam'])
  assert 'adam: not one of optax, auto, stream' in capsys.readouterr().err


# (b) the model's shape and the target GPU are flags.


def test_shape_flags_set_the_trainers_config():
  (fields,) = _cases(
    '--layers 3 --d-model 384 --heads 6 --mlp-dim 1536 --seq-len 512 '
    '--vocab 1024 --batch 2 --optimizers optax --layouts noscan --gpu h100'
  )
  cfg = _config(fields)
  got = (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.mlp_dim)
  assert got == (3, 384, 6, 1536)
  assert (cfg.seq_len, cfg.vocab_size, cfg.batch_size) == (512, 1024, 2)
  assert fields['gpu'] == 'h100'


def test_shape_flags_override_small_and_unset_ones_keep_the_presets():
  (fields,) = _cases('--small --seq-len 64 --optimizers optax --layouts scan')
  cfg = _config(fields)
  assert (cfg.d_model, cfg.seq_len, cfg.num_layers) == (256, 64, 20)
  (fields,) = _cases('--optimizers optax --layouts scan')
  cfg = _config(fields)
  assert (cfg.d_model, cfg.num_heads, cfg.seq_len) == (2048, 16, 2048)


def test_the_gpu_flag_takes_a_list_and_refuses_others(capsys):
  fields = _cases('--gpu h100,h200 --optimizers optax --layouts scan')
  assert [f['gpu'] for f in fields] == ['h100', 'h200']
  with pytest.raises(SystemExit):
    aot.parse_args(['--gpu', 'a100'])
  assert 'a100: not one of h100, h200, gh200' in capsys.readouterr().err


def test_a_bad_shape_is_refused_before_anything_compiles(monkeypatch, capsys):
  monkeypatch.setattr(aot, 'run_case', pytest.fail)
  argv = ['--d-model', '128', '--heads', '3', '--json', '/dev/null']
  assert aot.main(argv) == 2
  assert 'num_heads (3) must divide d_model (128)' in capsys.readouterr().err


# (c) the capacity search's cache: keyed by JAX and commit, never a
# committed file, never the --json output.


def _fake_compile(calls: list):
  """A stand-in for aot.run_case: bytes affine in the layers."""

  def run_case(fields: dict, timeout: float) -> dict:
    del timeout
    calls.append(fields)
    n = fields['layers']
    optax = fields['optimizer'] == 'optax'
    device = 2e9 + (0.9e9 if optax else 0.25e9) * n
    host = 0 if optax else 0.6e9 * n
    return {
      'case': f'{fields["optimizer"]}:{fields["moments"]}',
      'fields': fields,
      'compiles': True,
      'compile_s': 0.0,
      'num_params': 50_000_000 * n,
      'memory': {
        'argument_size_in_bytes': int(device),
        'host_argument_size_in_bytes': int(host),
      },
    }

  return run_case


def _capacity(tmp_path: pathlib.Path, *extra: str) -> list:
  calls: list = []
  argv = ['--capacity', '--small', '--gpu', 'h200', '--batch', '2']
  argv += ['--json', str(tmp_path / 'out.json')]
  argv += ['--cache-dir', str(tmp_path / 'cache'), *extra]
  patch = pytest.MonkeyPatch()
  patch.setattr(aot, 'run_case', _fake_compile(calls))
  try:
    assert aot.main(argv) == 0
  finally:
    patch.undo()
  return calls


def test_the_cache_file_is_named_by_jax_and_commit_and_ignored_by_git():
  key = {'jax': '0.12.0.1', 'commit': 'abc123+d1g35t'}
  path = aot_capacity.cache_path('build/aot_cache', key)
  assert (
    path == _ROOT / 'build/aot_cache/capacity_jax-0.12.0.1_abc123-d1g35t.json'
  )
  ignored = subprocess.run(
    ['git', 'check-ignore', '-q', str(path)], cwd=_ROOT, check=False
  )
  assert ignored.returncode == 0, f'{path} is not ignored by git'
  assert aot.parse_args([]).cache_dir == 'build/aot_cache'


def test_a_rerun_reuses_compiles_of_the_same_jax_and_commit_only(
  tmp_path, monkeypatch
):
  monkeypatch.setattr(
    aot_capacity, 'cache_key', lambda: {'jax': '0.12.0.1', 'commit': 'c1'}
  )
  first = _capacity(tmp_path)
  assert first
  assert _capacity(tmp_path) == []
  assert len(_capacity(tmp_path, '--fresh')) == len(first)
  for key in (
    {'jax': '0.12.0.1', 'commit': 'c2'},
    {'jax': '0.12.1', 'commit': 'c1'},
  ):
    monkeypatch.setattr(aot_capacity, 'cache_key', lambda key=key: key)
    assert len(_capacity(tmp_path)) == len(first), key
  out = json.loads((tmp_path / 'out.json').read_text())
  assert out['key'] == {'jax': '0.12.1', 'commit': 'c1'} and out['rows']


def test_the_json_output_and_committed_results_are_never_read(
  tmp_path, monkeypatch
):
  monkeypatch.setattr(
    aot_capacity, 'cache_key', lambda: {'jax': '0.12.0.1', 'commit': 'c1'}
  )
  first = _capacity(tmp_path)
  for cache in (tmp_path / 'cache').iterdir():
    cache.unlink()  # out.json still holds every compile, with its key.
  assert len(_capacity(tmp_path)) == len(first)
  committed = _ROOT / 'results' / 'aot_capacity.json'
  with pytest.raises(ValueError, match='a committed file'):
    aot_capacity.Compiles(committed, 1, None, aot_capacity.cache_key())


def test_the_commit_key_changes_with_uncommitted_code(tmp_path, monkeypatch):
  git = lambda *a: subprocess.run(  # noqa: E731
    ['git', *a], cwd=tmp_path, check=True, capture_output=True
  )
  git('init', '-q')
  code = tmp_path / 'jax_superoffload' / 'x.py'
  code.parent.mkdir()
  code.write_text('a = 1\n')
  git('add', '.')
  git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qm', 'x')
  monkeypatch.setattr(aot_capacity, '_ROOT', tmp_path)
  head = aot_capacity.library_commit()
  assert len(head) == 40
  (tmp_path / 'notes.txt').write_text('not code')
  assert aot_capacity.library_commit() == head
  code.write_text('a = 2\n')
  edited = aot_capacity.library_commit()
  code.write_text('a = 3\n')
  assert (
    edited.startswith(head + '+') and aot_capacity.library_commit() != edited
  )
  code.write_text('a = 1\n')
  (code.parent / 'new.py').write_text('b = 1\n')
  assert aot_capacity.library_commit() not in (head, edited)


def test_the_planner_reads_the_8b_compiles_it_is_compared_with(capsys):
  # The committed 8B results, by the 0.12.0.1 plugin's compiler: the
  # planner lands within 2% of the step after the loop and of fp32 optax
  # (tests/test_planner_compile.py: every committed compile).
  from experiments.device import aot_planner

  path = 'results/gpu_aot/8b_h100_plugin0.12.0.1_2026-12-07.json'
  assert aot_planner.main([str(pathlib.Path(__file__).parents[1] / path)]) == 0
  lines = dict(
    line.split(': ', 1) for line in capsys.readouterr().out.split('\n') if line
  )
  assert lines['optax:scan:float32'].endswith('(+1% device)')
  assert lines['auto=stream:scan:bfloat16:after-loop'].endswith('(+2% device)')


def test_grace_adam_is_filed_in_the_plugin_that_compiles(tmp_path):
  # `make test` names the CUDA plugin wheel's copy for registration; the
  # deviceless compiler loads another copy. Filed in the first, XLA:GPU
  # finds no handler and aborts the compile: the harness points the
  # registration at the copy it compiles with.
  compiling = tmp_path / 'jax_plugins' / 'xla_cuda13' / 'xla_cuda_plugin.so'
  compiling.parent.mkdir(parents=True)
  compiling.write_bytes(b'')
  code = (
    'import os\n'
    'from experiments.device import deviceless\n'
    'deviceless.add_plugin_path()\n'
    "print(os.environ['JAX_SUPEROFFLOAD_CUDA_PLUGIN'])\n"
  )
  env = dict(
    os.environ,
    JAX_SUPEROFFLOAD_CUDA_AOT=str(tmp_path),
    JAX_SUPEROFFLOAD_CUDA_PLUGIN='/elsewhere/xla_cuda_plugin.so',
  )
  done = subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    env=env,
    cwd=pathlib.Path(__file__).parents[1],
    check=True,
  )
  assert done.stdout.strip() == str(compiling)
