"""Tests for experiments.trainer: training, and the config files and flags."""

import dataclasses
import json
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.sweeps import sweep
from experiments.trainer import config
from experiments.trainer import config_cli
from experiments.trainer import config_files
from experiments.trainer import cpu_peak
from experiments.trainer import model
from experiments.trainer import train

# A short, highly repetitive corpus: a tiny model learns it in a few steps.
_CORPUS = 'the quick brown fox jumps over the lazy dog. ' * 400
_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TINY = str(_ROOT / 'configs' / 'tiny.py')


def _tiny_args(tmp_path, optimizer='optax', steps=30):
  data = tmp_path / 'corpus.txt'
  data.write_text(_CORPUS)
  return [
    f'--config={_TINY}',
    f'--config.optimizer={optimizer}',
    f'--config.data={data}',
    f'--config.out_dir={tmp_path / "run"}',
    f'--config.steps={steps}',
    '--noconfig.progress',
  ]


@pytest.fixture(scope='module')
def optax_run(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp('optax')
  cfg = config.config_from_args(_tiny_args(tmp_path))
  return cfg, train.train(cfg, log=lambda _: None)


def test_training_reduces_loss(optax_run):
  cfg, summary = optax_run
  assert summary['steps'] == cfg.steps == 30
  assert summary['total_tokens'] == 30 * cfg.batch_size * cfg.seq_len
  assert summary['final_loss'] < 0.6 * summary['first_loss']
  assert summary['tokens_per_s'] > 0
  assert set(summary['data_state']) == {'seed', 'epoch', 'index'}


def test_metrics_jsonl_written(optax_run):
  cfg, summary = optax_run
  out_dir = pathlib.Path(summary['out_dir'])
  lines = (out_dir / 'metrics.jsonl').read_text().splitlines()
  records = [json.loads(x) for x in lines]
  assert [r['step'] for r in records] == list(range(cfg.steps))
  for r in records:
    assert {'step', 'loss', 'tokens_per_s', 'lr'} <= set(r)
  assert records[0]['loss'] == pytest.approx(summary['first_loss'])
  lrs = [r['lr'] for r in records]
  assert max(lrs) == pytest.approx(cfg.learning_rate, rel=1e-5)
  saved = json.loads((out_dir / 'config.json').read_text())
  # Grouped as the config's sections (and --help) group the fields.
  assert set(saved) == {
    'preset',
    'model',
    'data',
    'optimizer',
    'offload',
    'distributed',
    'checkpoint',
    'logging',
  }
  assert saved['optimizer']['optimizer'] == 'optax'
  assert saved['model']['d_model'] == cfg.d_model
  flat = {
    k: v
    for group in saved.values()
    if isinstance(group, dict)
    for k, v in group.items()
  }
  assert flat == {
    k: v for k, v in dataclasses.asdict(cfg).items() if k != 'preset'
  }


def _losses(summary):
  path = pathlib.Path(summary['out_dir']) / 'metrics.jsonl'
  return [json.loads(x)['loss'] for x in path.read_text().splitlines()]


@pytest.mark.parametrize('optimizer', ['superoffload', 'device'])
def test_superoffload_optimizers_match_optax(tmp_path, optimizer, optax_run):
  pytest.importorskip('jax_superoffload')
  cfg = config.config_from_args(_tiny_args(tmp_path, optimizer))
  summary = train.train(cfg, log=lambda _: None)
  assert summary['optimizer'] == optimizer
  assert summary['final_loss'] < 0.6 * summary['first_loss']
  # Same init, data and AdamW math: the same losses up to fp32 rounding.
  np.testing.assert_allclose(
    _losses(summary), _losses(optax_run[1]), rtol=0, atol=1e-4
  )


def test_weight_decay_mask_skips_bias_norm_embedding():
  cfg = config.get_config('tiny', tie_embeddings=False, pos_encoding='learned')
  net = nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0)))
  params = nnx.as_pure(nnx.state(net, nnx.Param))
  mask = train.weight_decay_mask(params)
  decayed = {
    jax.tree_util.keystr(path)
    for path, keep in jax.tree_util.tree_leaves_with_path(mask)
    if keep
  }
  assert decayed == {
    "['blocks'][0]['attn']['qkv']['kernel']",
    "['blocks'][0]['attn']['out']['kernel']",
    "['blocks'][0]['mlp']['up']['kernel']",
    "['blocks'][0]['mlp']['down']['kernel']",
    "['lm_head']['kernel']",
  }


def test_config_flags_override_every_kind_of_field():
  cfg = config.config_from_args(
    [
      f'--config={_TINY}',
      '--config.steps=7',
      '--config.batch_size',  # The value as the next argument.
      '3',
      '--config.learning_rate=0.5',
      '--noconfig.tie_embeddings',
      '--config.pos_encoding=learned',
      '--config.data=some/file.txt',
      '--config.bucket_mib=none',  # An optional field set to None.
      '--config.clip_norm=0.5',  # A placeholder (None) given a value.
    ]
  )
  assert cfg.preset == 'tiny'
  assert (cfg.steps, cfg.batch_size) == (7, 3)
  assert cfg.learning_rate == 0.5
  assert cfg.tie_embeddings is False
  assert cfg.pos_encoding == 'learned'
  assert cfg.data == 'some/file.txt'
  assert (cfg.bucket_mib, cfg.clip_norm) == (None, 0.5)
  assert cfg.d_model == config.get_config('tiny').d_model != 128
  default = config.config_from_args([])
  assert default == config.Config()
  assert default.optimizer == 'superoffload'
  # The acceptance command's form, the file as the next argument.
  cfg = config.config_from_args(
    ['--config', 'configs/demo.py', '--config.steps=50']
  )
  assert cfg == config.Config(steps=50)


def test_older_flags_are_aliases_for_one_release():
  old = [
    '--preset=tiny',
    '--steps=7',
    '--batch-size',
    '3',
    '--no-tie-embeddings',
    '--data=none',
    '--no-progress',
  ]
  new = [
    f'--config={_TINY}',
    '--config.steps=7',
    '--config.batch_size=3',
    '--config.tie_embeddings=false',
    '--config.data=none',
    '--config.progress=false',
  ]
  assert config.config_from_args(old) == config.config_from_args(new)
  assert config_cli.old_flags(old) == [
    '--preset',
    '--steps',
    '--batch-size',
    '--no-tie-embeddings',
    '--data',
    '--no-progress',
  ]
  assert config_cli.old_flags(new) == []


def test_help_lists_every_field_with_its_help(capsys):
  with pytest.raises(SystemExit) as exit_info:
    config.config_from_args([f'--config={_TINY}', '--help'])
  assert exit_info.value.code == 0
  help_text = ' '.join(capsys.readouterr().out.split())
  assert help_text.startswith('usage: python -m experiments.trainer')
  grouped_names = [n for ns in config.field_groups().values() for n in ns]
  for field in dataclasses.fields(config.Config):
    assert config.field_help(field.name), field.name
    if field.name == 'preset':
      continue
    assert grouped_names.count(field.name) == 1, field.name
    # The field's metadata, then the start file's value.
    text = ' '.join(config.field_help(field.name).split())
    assert f'--config.{field.name} ' in help_text, field.name
    assert text in help_text, field.name
  assert '--config.d_model INT Width of the residual stream. (tiny: 32)' in (
    help_text
  )


def test_config_files_and_names_are_the_same_configs():
  names = config_files.preset_names()
  assert {
    'tiny',
    'demo',
    '125m',
    '350m',
    '1b',
    'llama8b',
    'paper_gh200_25b',
  } <= set(names)
  for name in names:
    by_file = config.config_from_args([f'--config=configs/{name}.py'])
    assert by_file == config.config_from_args([f'--config={name}'])
    assert by_file == config.config_from_args([f'--preset={name}'])
    assert by_file.preset == name
    config.validate(by_file)
  # The demo is the dataclass's defaults, and what no flag at all gives;
  # "small" is its older name.
  assert config.get_config('demo') == config.Config() == config.get_config()
  assert config.get_config('small') == config.Config()


def test_the_8b_config_has_llama_8bs_blocks():
  # Llama 3 8B's block: 4096 * (2.5 * 4096) attention (grouped heads) +
  # 3 * 4096 * 14336 gated MLP; ours is plain, at the same count, plus
  # two norms' scales of 4096 (no biases anywhere).
  cfg = config.get_config('llama8b')
  config.validate(cfg)
  shapes = nnx.state(nnx.eval_shape(lambda: model.init_model(cfg)))
  count = sum(x.size for x in jax.tree.leaves(shapes))
  llama_block = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336
  blocks = 32 * (llama_block + 2 * 4096)
  embeddings = 2 * 32000 * 4096  # Untied, as Llama's.
  assert count == blocks + embeddings + 4096  # And the final norm.
  assert count == 7_241_732_096


def test_config_file_outside_configs_with_overrides(tmp_path):
  path = tmp_path / 'mine.py'
  path.write_text(
    'from experiments.trainer import config_files\n'
    'def get_config():\n'
    '  cfg = config_files.defaults()\n'
    '  cfg.d_model = 64\n'
    '  cfg.steps = 9\n'
    '  return cfg\n'
  )
  cfg = config.config_from_args([f'--config={path}', '--config.steps=3'])
  assert (cfg.d_model, cfg.steps, cfg.preset) == (64, 3, str(path))
  config.validate(cfg)
  # A file of the older form, returning a Config, still reads the same.
  path.write_text(
    'from experiments.trainer import config\n'
    'def get_config():\n'
    '  return config.Config(d_model=64, steps=9)\n'
  )
  assert cfg == config.config_from_args([f'--config={path}', '--steps=3'])


@pytest.mark.parametrize(
  'text, message',
  [
    ('x = 1\n', 'get_config() must return an ml_collections.ConfigDict'),
    ('def get_config():\n  return {}\n', 'ConfigDict, got dict'),
    ('raise KeyError("d_model")\n', "KeyError: 'd_model'"),
    (
      'import ml_collections\n'
      'def get_config():\n'
      '  return ml_collections.ConfigDict({"stepz": 3})\n',
      'no such config field: stepz',
    ),
    (
      'from experiments.trainer import config_files\n'
      'def get_config():\n'
      '  cfg = config_files.defaults()\n'
      '  cfg.unlock()\n'
      '  del cfg.steps\n'
      '  cfg.steps = "many"\n'
      '  return cfg\n',
      "steps = 'many'",
    ),
  ],
)
def test_bad_config_file_is_a_config_error(tmp_path, text, message):
  path = tmp_path / 'bad.py'
  path.write_text(text)
  with pytest.raises(config.ConfigError, match=re.escape(message)):
    config.config_from_args([f'--config={path}'])
  with pytest.raises(config.ConfigError, match='name one config file'):
    config.config_from_args([f'--config={path}', '--preset=tiny'])


def test_library_value_errors_become_config_errors():
  # Past `validate` (a config built in code): the library's own check.
  cfg = config.get_config('tiny', device_buckets=5.0)
  with pytest.raises(config.ConfigError, match='optimizer: device_buckets'):
    train.make_optimizer(cfg, 0.1)


@pytest.mark.parametrize('optimizer', ['optax', 'superoffload'])
def test_skip_nonfinite_drops_a_nan_step(optimizer):
  cfg = config.get_config('tiny', optimizer=optimizer, skip_nonfinite=True)
  tx = train.make_optimizer(cfg, 0.1)
  params = {'w': jax.numpy.ones((4, 4))}
  state = tx.init(params)
  nan_grads = {'w': jax.numpy.full((4, 4), jax.numpy.nan)}
  updates, state = tx.update(nan_grads, state, params)
  new_params = optax.apply_updates(params, updates)
  assert np.array_equal(new_params['w'], params['w'])


def test_help_shows_every_line_of_a_field_comment():
  help_text = ' '.join(config_cli.format_help().split())
  assert (
    "superoffload: bucket size in MiB (None: the library's 256). Small "
    'buckets start their host step while the backward pass still runs.'
  ) in help_text
  for group in ('model', 'data', 'optimizer', 'offload', 'checkpoint'):
    assert f'{group}:' in help_text


def test_unknown_optimizer_and_preset_raise():
  with pytest.raises(ValueError, match='optimizer'):
    train.make_optimizer(config.get_config('tiny', optimizer='sgd'), 0.1)
  with pytest.raises(ValueError, match="no config named 'huge'"):
    config.get_config('huge')


def test_weight_flow_and_stv_options_train_like_stationary(tmp_path):
  runs = {}
  for policy in ('stationary', 'flow'):
    (tmp_path / policy).mkdir()
    args = [
      *_tiny_args(tmp_path / policy, 'superoffload', steps=6),
      '--config.scan_layers',
      f'--config.weights_policy={policy}',
      '--config.clip_norm=0.5',
      '--config.skip_nonfinite',
    ]
    runs[policy] = train.train(
      config.config_from_args(args), log=lambda _: None
    )
  # Streaming the weights from host memory changes where they live, never
  # the numbers.
  assert _losses(runs['flow']) == _losses(runs['stationary'])
  assert runs['flow']['final_loss'] < runs['flow']['first_loss']


def _unknown(value) -> bool:
  """An MFU without a peak: None in JSON, or NaN."""
  return value is None or (isinstance(value, float) and np.isnan(value))


def test_summary_json_plot_and_mfu(optax_run):
  cfg, summary = optax_run
  out_dir = pathlib.Path(summary['out_dir'])
  saved = json.loads((out_dir / 'summary.json').read_text())
  # Every key the sweep reads (its contract with the trainer).
  assert set(sweep.SUMMARY_KEYS) <= set(saved)
  assert (saved['preset'], saved['optimizer']) == ('tiny', 'optax')
  assert saved['executor'] is None
  assert saved['steps'] == cfg.steps
  assert saved['num_params'] == summary['num_params']
  assert saved['final_loss'] == pytest.approx(summary['final_loss'])
  # MFU needs this CPU's peak (results/cpu_peak.json); a CPU with none
  # recorded shows no MFU and says how to record one, never a guess.
  recorded = cpu_peak.recorded_peak(cfg.dtype)[0] is not None
  if recorded:
    assert 0 < saved['mfu'] < 1
  else:
    assert _unknown(saved['mfu']) and 'cpu_peak' in saved['peak_source']
  assert saved['step_time_s_median'] > 0
  # optax: params (4 B) and its fp32 mu and nu (8 B), all on the device.
  assert saved['host_bytes_per_param'] == 0
  assert saved['device_bytes_per_param'] == pytest.approx(12, abs=0.01)
  records = [
    json.loads(x) for x in (out_dir / 'metrics.jsonl').read_text().splitlines()
  ]
  assert all(
    0 < r['mfu'] < 1 if recorded else _unknown(r['mfu']) for r in records
  )
  png = (out_dir / 'loss_curve.png').read_bytes()
  assert png.startswith(b'\x89PNG')


def test_mesh_data_sequence_parallel_and_zero_match_one_device(
  tmp_path, optax_run
):
  pytest.importorskip('jax_superoffload')
  assert len(jax.devices()) >= 4  # conftest.py: 8 CPU devices.
  args = [
    *_tiny_args(tmp_path, 'superoffload'),
    '--config.mesh_data=2',
    '--config.mesh_seq=2',
    '--config.zero',
  ]
  lines = []
  summary = train.train(config.config_from_args(args), log=lines.append)
  assert any('zero(replicated state ' in line for line in lines), lines[:3]
  assert summary['final_loss'] < 0.6 * summary['first_loss']
  # Sharded batch, Ulysses attention over global RoPE positions, replicated
  # parameters, ZeRO-sharded Adam state: the 1-device losses up to the
  # order of reductions.
  np.testing.assert_allclose(
    _losses(summary), _losses(optax_run[1]), rtol=0, atol=1e-4
  )
  # Every device holds all parameters (4 B) and, with ZeRO, half of the
  # fp32 master, mu and nu (12 B/param in all).
  assert summary['device_bytes_per_param'] == pytest.approx(4, rel=0.01)
  assert summary['host_bytes_per_param'] == pytest.approx(6, rel=0.01)


@pytest.mark.parametrize(
  'flags, message',
  [
    (['--config=huge'], '--config huge: no such file, and no config of that'),
    (['--config=configs/nope.py'], '--config: no such file: configs/nope.py'),
    (['--config.stepz=3'], 'no such config field: stepz (did you mean --con'),
    (['--config.steps=many'], '--config.steps=many: invalid literal for int'),
    (['--config.zero=maybe'], 'Non-boolean argument to boolean flag'),
    (['--steps=1', 'extra'], "unrecognized argument 'extra'"),
    (['--config.mesh_seq=3'], 'seq_len (32) must be divisible'),
    (['--config.mesh_seq=4'], 'num_heads (2) must be divisible'),
    (['--config.mesh_data=3'], 'batch_size (4) must be divisible'),
    (
      ['--config.mesh_data=8', '--config.mesh_seq=2', '--config.batch_size=8'],
      'only 8 cpu device(s) exist',
    ),
    (['--config.data=/no/such/corpus.txt'], 'no such file or folder'),
    (['--config.num_heads=3'], 'num_heads (3) must divide d_model (32)'),
    (['--config.steps=0'], 'steps must be at least 1'),
    (['--config.optimizer=optax', '--config.zero'], 'zero needs --config.opt'),
    # Values that cannot train, or that the library would refuse late.
    (['--config.learning_rate=nan'], 'learning_rate must be finite'),
    (['--config.learning_rate=-1'], 'learning_rate must be positive'),
    (['--config.learning_rate=inf'], 'learning_rate must be finite'),
    (['--config.vocab_size=10'], 'vocab_size (10) is smaller than the data'),
    (['--config.clip_norm=-1'], 'clip_norm must be positive'),
    (['--config.clip_norm=0'], 'clip_norm must be positive'),
    (['--config.b1=1.5'], 'b1 must be in [0, 1)'),
    (['--config.b2=nan'], 'b2 must be in [0, 1)'),
    (['--config.eps=-1'], 'eps must be >= 0'),
    (['--config.weight_decay=nan'], 'weight_decay must be finite'),
    (['--config.device_buckets=5'], 'device_buckets must be in [0, 1]'),
    (['--config.dtype=float99'], "dtype='float99' is not one of"),
    (['--config.param_dtype=int8'], "param_dtype='int8' is not one of"),
    (['--config.schedule=exp'], "schedule='exp' is not one of"),
    (['--config.grad_accum=0'], 'grad_accum must be at least 1'),
    (['--config.profile_steps=5:2'], 'profile_steps must be "a:b"'),
    (
      ['--config.eval_every=5', '--config.eval_fraction=0'],
      'needs --config.eval_fraction',
    ),
    (['--config.eval_every=5', '--config.eval_fraction=1e-6'], 'held-out'),
    # The older spellings still reach the same checks.
    (['--preset=huge'], '--config huge: no such file'),
    (['--batch-size=many'], "invalid literal for int() with base 10: 'many'"),
  ],
)
def test_bad_configs_are_one_line_errors(flags, message, capsys, tmp_path):
  data = tmp_path / 'corpus.txt'
  data.write_text(_CORPUS)
  names_a_file = any(f.startswith(('--config=', '--preset=')) for f in flags)
  argv = [
    *([] if names_a_file else ['--config=tiny']),
    f'--config.data={data}',
    f'--config.out_dir={tmp_path / "run"}',
  ]
  assert train.main([*argv, *flags]) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and err.count('\n') == 1, err
  assert message in err
  assert not (tmp_path / 'run').exists()


def test_flops_and_peak_helpers():
  from experiments.trainer import perf

  assert perf.flops_per_token(100, 2, 8, 16) == 6 * 100 + 12 * 2 * 8 * 16
  # The peaks themselves: tests/test_trainer_metrics.py.
  assert np.isnan(perf.mfu(100.0, 1e6, None))
  assert perf.mfu(100.0, 1e6, 1e9) == pytest.approx(0.1)


def test_bytes_by_memory_kind_counts_one_shard():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from experiments.trainer import perf

  mesh = jax.make_mesh((4,), ('data',), devices=jax.devices()[:4])
  tree = {
    'sharded': jax.device_put(
      np.zeros(64, np.float32),
      NamedSharding(mesh, P('data'), memory_kind='pinned_host'),
    ),
    'replicated': jax.device_put(
      np.zeros(8, np.float32), NamedSharding(mesh, P())
    ),
  }
  got = perf.bytes_by_memory_kind(tree, jax.devices()[0])
  assert got == {'host': 64 * 4 // 4, 'device': 8 * 4}


@pytest.mark.parametrize('module', ['experiments.trainer', 'experiments.train'])
def test_the_command_and_its_older_name_refuse_bad_flags(module):
  out = subprocess.run(
    [
      sys.executable,
      '-m',
      module,
      '--config=configs/tiny.py',
      '--config.steps=0',
    ],
    capture_output=True,
    text=True,
    cwd=_ROOT,
    timeout=300,
  )
  assert out.returncode == 2
  assert out.stderr.splitlines() == ['error: steps must be at least 1, got 0']


def test_the_older_name_trains_from_a_config_file(tmp_path):
  data = tmp_path / 'corpus.txt'
  data.write_text(_CORPUS)
  out = subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.train',
      f'--config={_TINY}',
      '--config.steps=2',
      f'--config.data={data}',
      f'--config.out_dir={tmp_path / "run"}',
      '--noconfig.progress',
      '--noconfig.tensorboard',
    ],
    capture_output=True,
    text=True,
    cwd=tmp_path,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
  assert summary['steps'] == 2
  saved = json.loads((tmp_path / 'run' / 'config.json').read_text())
  assert saved['preset'] == 'tiny'
