"""Turns sweep results and the benchmark JSONs into markdown tables and plots.

  python -m experiments.analyze results/sweep/cpu_optimizers.jsonl
  python -m experiments.analyze SWEEP.jsonl [...] --results-dir results \
      --out-dir results/sweep

Reads the sweep JSONL files written by `experiments.sweep` (the last record
of each run id wins) and, from ``--results-dir``, ``bench_adam.json``,
``bench_step.json`` and ``paper_predictions.json`` when they exist. Writes
``tables.md`` and these PNGs to ``--out-dir``:

- ``sweep_throughput.png``: tokens/s and median step time vs parameters, one
  line per optimizer.
- ``sweep_bytes_per_param.png``: resident host and device bytes per
  parameter for each model size and optimizer.
- ``bench_adam.png``: one AdamW step, Grace Adam vs its peers.
- ``bench_step.png``: a whole optimizer step, STV on and off, 1 vs many
  leaves.
- ``paper_predictions.png``: the cost model's GH200 predictions beside the
  paper's figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import statistics
import sys
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt
from matplotlib import ticker

# Plot order and colours of the sweep's optimizers; others follow.
OPTIMIZER_ORDER = ('superoffload', 'optax', 'device')
COLORS = {
  'superoffload': 'tab:blue',
  'optax': 'tab:orange',
  'device': 'tab:green',
}


def fmt(value: Any, spec: str = ',.0f', none: str = '-') -> str:
  """Formats a number, or `none` for a missing / NaN value."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return none
  return format(value, spec)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
  """A GitHub-flavoured markdown table."""
  lines = ['| ' + ' | '.join(header) + ' |']
  lines.append('|' + '---|' * len(header))
  lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
  return '\n'.join(lines)


def load_runs(paths: Iterable[str | pathlib.Path]) -> list[dict[str, Any]]:
  """The last record of every run id in the sweep JSONL files, in order.

  Args:
    paths: JSONL files; lines that do not parse are skipped.

  Returns:
    One record per run id, in the order each id first appeared.
  """
  latest: dict[str, dict[str, Any]] = {}
  for path in paths:
    for line in pathlib.Path(path).read_text().splitlines():
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict) and 'run_id' in record:
        latest[record['run_id']] = record
  return list(latest.values())


def run_rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
  """Flattens sweep records into one dict of table fields per run."""
  rows = []
  for r in records:
    grid = r.get('grid', {})
    summary = r.get('summary') or {}
    step_s = summary.get('step_time_s_median')
    error = (r.get('error') or '').strip().splitlines()
    rows.append(
      {
        'run_id': r['run_id'],
        'model': grid.get('model'),
        'seq_len': grid.get('seq_len'),
        'weights_policy': grid.get('weights_policy'),
        'optimizer': grid.get('optimizer_name') or summary.get('optimizer'),
        'repeat': grid.get('repeat'),
        'executor': summary.get('executor') or grid.get('executor'),
        'status': r.get('status'),
        'num_params': summary.get('num_params'),
        'step_ms': None if step_s is None else 1e3 * step_s,
        'tokens_per_s': summary.get('tokens_per_s'),
        'host_bpp': summary.get('host_bytes_per_param'),
        'device_bpp': summary.get('device_bytes_per_param'),
        'first_loss': summary.get('first_loss'),
        'final_loss': summary.get('final_loss'),
        'mfu': summary.get('mfu'),
        'summary_source': r.get('summary_source'),
        'started_at': r.get('started_at'),
        'error': error[-1] if error else '',
      }
    )
  return rows


def _optimizer_key(name: str) -> tuple[int, str]:
  order = OPTIMIZER_ORDER.index(name) if name in OPTIMIZER_ORDER else 99
  return order, name


def _setting(row: dict[str, Any]) -> tuple[Any, Any, Any]:
  return row['model'], row['seq_len'], row['weights_policy']


def aggregate(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per grid point over its repeats: medians and ranges.

  Args:
    rows: From `run_rows`.

  Returns:
    Rows with the fields of `run_rows` (step time and tokens/s: medians
    over the ok repeats; the rest from the first ok one), plus ``runs``,
    ``ok``, ``step_ms_min`` and ``step_ms_max``; ``status`` is ``ok`` when
    every repeat is, else ``k/n ok``.
  """
  groups: dict[Any, list[dict[str, Any]]] = {}
  for r in rows:
    groups.setdefault((*_setting(r), r['optimizer']), []).append(r)
  out = []
  for runs in groups.values():
    ok = [r for r in runs if r['status'] == 'ok' and r['step_ms'] is not None]
    row = dict(ok[0] if ok else runs[-1])
    times = [r['step_ms'] for r in ok]
    tps = [r['tokens_per_s'] for r in ok if r['tokens_per_s'] is not None]
    row.update(
      runs=len(runs),
      ok=len(ok),
      step_ms=statistics.median(times) if times else None,
      step_ms_min=min(times) if times else None,
      step_ms_max=max(times) if times else None,
      tokens_per_s=statistics.median(tps) if tps else None,
      status='ok' if len(ok) == len(runs) else f'{len(ok)}/{len(runs)} ok',
    )
    if not ok:
      row['status'] = runs[-1]['status']
    out.append(row)
  return out


def sweep_table(rows: Sequence[dict[str, Any]]) -> str:
  """Every grid point: status, speed (median over repeats), memory, loss."""
  agg = aggregate(rows)
  repeated = any(r['runs'] > 1 for r in agg)
  header = ['model', 'params', 'seq', 'weights', 'optimizer', 'status']
  header += ['median step ms']
  if repeated:
    header += ['runs', 'step ms range']
  header += [
    'tokens/s',
    'vs optax',
    'host B/param',
    'device B/param',
    'loss first -> final',
  ]
  optax_ms = {
    _setting(r): r['step_ms']
    for r in agg
    if r['optimizer'] == 'optax' and r['step_ms']
  }
  body = []
  for r in agg:
    base = optax_ms.get(_setting(r))
    ratio = base / r['step_ms'] if base and r['step_ms'] else None
    loss = '-'
    if r['first_loss'] is not None and r['final_loss'] is not None:
      loss = f'{r["first_loss"]:.3f} -> {r["final_loss"]:.3f}'
    line = [
      r['model'],
      fmt(r['num_params']),
      fmt(r['seq_len'], 'd'),
      r['weights_policy'] or '-',
      r['optimizer'],
      r['status'],
      fmt(r['step_ms'], ',.1f'),
    ]
    if repeated:
      spread = '-'
      if r['step_ms_min'] is not None:
        spread = f'{r["step_ms_min"]:,.1f}-{r["step_ms_max"]:,.1f}'
      line += [str(r['runs']), spread]
    line += [
      fmt(r['tokens_per_s'], ',.1f'),
      fmt(ratio, '.2f') + ('x' if ratio else ''),
      fmt(r['host_bpp'], '.1f'),
      fmt(r['device_bpp'], '.1f'),
      loss,
    ]
    body.append(line)
  return markdown_table(header, body)


def comparison_table(
  rows: Sequence[dict[str, Any]],
  target: str = 'superoffload',
  base: str = 'optax',
) -> tuple[str, int]:
  """Median step time of every optimizer per setting, `target` vs `base`.

  With repeats, a setting's step time is the median over its ok repeats,
  and a column counts the passes in which `target` was at least as fast as
  `base` (both measured in that pass).

  Args:
    rows: From `run_rows`.
    target: The optimizer whose speed is judged.
    base: The optimizer it is compared with.

  Returns:
    The markdown table and the number of settings where `target`'s median
    step time is at most `base`'s.
  """
  agg = aggregate(rows)
  repeated = any(r['runs'] > 1 for r in agg)
  names = sorted({r['optimizer'] for r in agg}, key=_optimizer_key)
  by_setting: dict[Any, dict[str, dict[str, Any]]] = {}
  for r in agg:
    if r['step_ms'] is not None:
      by_setting.setdefault(_setting(r), {})[r['optimizer']] = r
  passes: dict[Any, dict[Any, dict[str, float]]] = {}
  for r in rows:
    if r['status'] == 'ok' and r['step_ms'] is not None:
      per_pass = passes.setdefault(_setting(r), {})
      per_pass.setdefault(r['repeat'], {})[r['optimizer']] = r['step_ms']
  header = ['model', 'params', 'seq', 'weights']
  header += [f'{n} ms' for n in names]
  header += [f'{base} / {target}', f'{target} <= {base}']
  if repeated:
    header.append('passes with <=')
  body, wins = [], 0
  for setting, runs in by_setting.items():
    params = next(iter(runs.values()))['num_params']
    line = [setting[0], fmt(params), fmt(setting[1], 'd'), setting[2] or '-']
    line += [
      fmt(runs[n]['step_ms'], ',.1f') if n in runs else '-' for n in names
    ]
    t, b = runs.get(target), runs.get(base)
    if t and b:
      win = t['step_ms'] <= b['step_ms']
      wins += win
      line += [f'{b["step_ms"] / t["step_ms"]:.2f}x', 'yes' if win else 'no']
    else:
      line += ['-', '-']
    if repeated:
      both = [
        p for p in passes.get(setting, {}).values() if target in p and base in p
      ]
      won = sum(p[target] <= p[base] for p in both)
      line.append(f'{won}/{len(both)}')
    body.append(line)
  return markdown_table(header, body), wins


def failure_table(rows: Sequence[dict[str, Any]]) -> str | None:
  """Runs that failed or timed out, with the last line of their error."""
  bad = [r for r in rows if r['status'] != 'ok']
  if not bad:
    return None
  body = [
    [r['run_id'], r['status'], r['error'].replace('|', '\\|')] for r in bad
  ]
  return markdown_table(['run', 'status', 'error (last line)'], body)


def _series(
  rows: Sequence[dict[str, Any]],
) -> dict[str, list[dict[str, Any]]]:
  """Grid points with an ok run, as lines: optimizer (+ seq, weights)."""
  ok = [r for r in aggregate(rows) if r['step_ms'] and r['num_params']]
  vary_seq = len({r['seq_len'] for r in ok}) > 1
  vary_policy = len({r['weights_policy'] for r in ok}) > 1
  lines: dict[str, list[dict[str, Any]]] = {}
  for r in sorted(ok, key=lambda r: _optimizer_key(r['optimizer'])):
    label = r['optimizer']
    if vary_seq:
      label += f' s{r["seq_len"]}'
    if vary_policy:
      label += f' {r["weights_policy"]}'
    lines.setdefault(label, []).append(r)
  for points in lines.values():
    points.sort(key=lambda r: r['num_params'])
  return lines


def _plain(value: float, _: Any) -> str:
  """Tick label without exponents; minor ticks only at 2, 3, 5 x 10^k."""
  if value <= 0:
    return ''
  mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
  if round(mantissa, 6) not in (1, 2, 3, 5):
    return ''
  return f'{value:g}'


def _plot_bars(lines: dict[str, list[dict[str, Any]]], path: pathlib.Path):
  """Tokens/s and step time as bars, one per line label (one model size)."""
  labels = list(lines)
  points = [lines[k][0] for k in labels]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  colors = [COLORS.get(p['optimizer'], 'tab:gray') for p in points]
  for ax, key, title in (
    (axes[0], 'tokens_per_s', 'tokens/s (step 0 excluded)'),
    (axes[1], 'step_ms', 'median step time, ms (step 0 excluded)'),
  ):
    values = [p[key] for p in points]
    bars = ax.bar(range(len(labels)), values, color=colors)
    ax.bar_label(bars, labels=[fmt(v, ',.1f') for v in values], fontsize=8)
    ax.set_xticks(range(len(labels)), [k.replace(' ', '\n') for k in labels])
    ax.set_ylabel(title)
    ax.grid(True, axis='y', alpha=0.3)
  model = f'{points[0]["model"]} ({points[0]["num_params"] / 1e6:.1f}M params)'
  fig.suptitle(f'Training step, {model}')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_throughput(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> None:
  """Tokens/s and median step time vs parameter count, per optimizer.

  With a single model size, bars per optimizer/setting instead.
  """
  lines = _series(rows)
  if len({p['num_params'] for ps in lines.values() for p in ps}) == 1:
    _plot_bars(lines, path)
    return
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for label, points in lines.items():
    color = COLORS.get(points[0]['optimizer'])
    x = [p['num_params'] / 1e6 for p in points]
    axes[0].plot(
      x, [p['tokens_per_s'] for p in points], 'o-', label=label, color=color
    )
    ms = [p['step_ms'] for p in points]
    spread = [
      [m - p['step_ms_min'] for m, p in zip(ms, points, strict=True)],
      [p['step_ms_max'] - m for m, p in zip(ms, points, strict=True)],
    ]
    axes[1].errorbar(
      x, ms, yerr=spread, fmt='o-', capsize=3, label=label, color=color
    )
  params = sorted({p['num_params'] / 1e6 for ps in lines.values() for p in ps})
  axes[0].set_ylabel('tokens/s (step 0 excluded)')
  axes[1].set_ylabel('median step time, ms (bars: range over repeats)')
  for ax in axes:
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('parameters (M)')
    ax.set_xticks(params, [f'{p:.3g}' for p in params])
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(_plain))
    ax.yaxis.set_minor_formatter(ticker.FuncFormatter(_plain))
    ax.grid(True, which='both', alpha=0.3)
    ax.legend()
  axes[0].set_title('Training throughput vs model size')
  axes[1].set_title('Step time vs model size')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_bytes(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> None:
  """Grouped bars: host and device bytes/param per model size and series.

  A series is an optimizer, plus the sequence length and weights policy
  when those vary in the sweep (as the lines of `plot_throughput`).
  """
  lines = _series(rows)
  models = sorted(
    {(p['num_params'], p['model']) for v in lines.values() for p in v}
  )
  names = list(lines)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
  width = 0.8 / max(1, len(names))
  for ax, key, title in (
    (axes[0], 'host_bpp', 'host memory (pinned_host)'),
    (axes[1], 'device_bpp', 'device memory'),
  ):
    for j, name in enumerate(names):
      values = []
      for _, model in models:
        match = [
          p[key]
          for p in lines[name]
          if p['model'] == model and p[key] is not None
        ]
        values.append(match[0] if match else math.nan)  # No bar.
      xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(models))]
      color = COLORS.get(name) if len(names) <= len(COLORS) else None
      bars = ax.bar(xs, values, width, label=name, color=color)
      labels = [fmt(v, '.1f', none='n/a') for v in values]
      ax.bar_label(bars, labels=labels, fontsize=8)
    ax.set_xticks(
      range(len(models)), [f'{m}\n{p / 1e6:.1f}M' for p, m in models]
    )
    ax.set_title(f'Resident bytes/param, {title}')
    ax.set_xlabel('model (parameters)')
    ax.grid(True, axis='y', alpha=0.3)
  axes[0].set_ylabel('bytes per parameter (params + optimizer state)')
  axes[0].set_ylim(top=max(axes[0].get_ylim()[1], 1) * 1.12)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc='upper center', ncol=min(len(names), 4))
  fig.tight_layout(rect=(0, 0, 1, 0.92))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def bench_adam_section(data: dict[str, Any], out_dir: pathlib.Path) -> str:
  """Table and bar chart of `results/bench_adam.json`."""
  rows = data['rows']
  table = markdown_table(
    ['candidate', 'median ms', 'Mparam/s', 'vs limit'],
    [
      [
        r['name'],
        fmt(1e3 * r['median_s'], '.1f'),
        fmt(r['mparam_per_s']),
        # Older runs judged against the kernel's own loop ('vs_roofline').
        fmt(r.get('vs_limit', r.get('vs_roofline')), '.2f'),
      ]
      for r in rows
    ],
  )
  ratios = data.get('ratios', {})
  fig, ax = plt.subplots(figsize=(9, 4.2))
  names = [r['name'] for r in rows]
  values = [r['mparam_per_s'] for r in rows]
  colors = [
    'tab:gray'
    if 'roofline' in n or n.startswith('limit')
    else 'tab:blue'
    if n.startswith('grace')
    else 'tab:orange'
    for n in names
  ]
  bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
  ax.bar_label(bars, fmt='%.0f', fontsize=8)
  ax.set_xlabel('Mparam/s (higher is better)')
  ax.set_title(
    f'One AdamW step over {data["params"] / 1e6:.0f}M fp32 params '
    f'(median of {data["reps"]})'
  )
  ax.grid(True, axis='x', alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_dir / 'bench_adam.png', dpi=110)
  plt.close(fig)
  machine = data.get('machine', {})
  lines = [
    '## Grace Adam vs its peers (`results/bench_adam.json`)',
    '',
    f'One AdamW step over {data["params"]:,} fp32 parameters, median of '
    f'{data["reps"]}; {data.get("date", "?")}, '
    f'{machine.get("cpu_model", "?")}, {machine.get("cpus", "?")} '
    f'CPUs, kernel ISA {machine.get("kernel_isa", "?")}, jax '
    f'{machine.get("jax", "?")}.',
    '',
    table,
    '',
    f'Grace Adam / optax.adamw: {fmt(ratios.get("ours_vs_optax"), ".2f")}x; '
    f'Grace Adam / fastest peer ({ratios.get("fastest_peer", "?")}): '
    f'{fmt(ratios.get("ours_vs_fastest_peer"), ".2f")}x.',
    '',
    '![bench_adam](bench_adam.png)',
  ]
  return '\n'.join(lines)


def bench_step_section(data: dict[str, Any], out_dir: pathlib.Path) -> str:
  """Table and grouped bars of `results/bench_step.json` (STV ablation)."""
  rows = data['rows']
  leaves = data.get('leaves', 'many')
  table = markdown_table(
    [
      'optimizer',
      '1 leaf ms',
      f'{leaves} leaves ms',
      f'{leaves} / 1',
      'vs optax (1 leaf)',
    ],
    [
      [
        r['optimizer'],
        fmt(1e3 * r['one_leaf_s'], '.1f'),
        fmt(1e3 * r['many_leaves_s'], '.1f'),
        fmt(r['many_over_one'], '.2f'),
        fmt(r['speedup_vs_optax_one_leaf'], '.2f'),
      ]
      for r in rows
    ],
  )
  stv = data.get('stv_over_plain', {})
  stv_text = ', '.join(f'{k}: {v:.2f}' for k, v in stv.items())
  fig, ax = plt.subplots(figsize=(10, 4.2))
  width = 0.38
  xs = range(len(rows))
  for k, (key, label) in enumerate(
    (('one_leaf_s', '1 leaf'), ('many_leaves_s', f'{leaves} leaves'))
  ):
    bars = ax.bar(
      [x + (k - 0.5) * width for x in xs],
      [1e3 * r[key] for r in rows],
      width,
      label=label,
    )
    ax.bar_label(bars, fmt='%.0f', fontsize=8)
  ax.set_xticks(list(xs), [r['optimizer'].replace(' + ', '\n+ ') for r in rows])
  ax.set_ylabel('median step ms (lower is better)')
  ax.set_title(
    f'update + apply_updates, {data["params"] / 1e6:.0f}M params, donated '
    f'(STV time / plain: {stv_text})'
  )
  ax.legend()
  ax.grid(True, axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_dir / 'bench_step.png', dpi=110)
  plt.close(fig)
  lines = [
    '## STV on/off and leaf count (`results/bench_step.json`)',
    '',
    f'`update` + `optax.apply_updates`, jitted and donated, '
    f'{data["params"]:,} fp32 parameters as 1 leaf and as {leaves} leaves, '
    f'median of {data["reps"]}; {data.get("date", "?")}. STV armed '
    f'(clip_norm set, never triggering) over plain ffi, time ratio: '
    f'{stv_text} (below 1: STV faster).',
    '',
    table,
    '',
    '![bench_step](bench_step.png)',
  ]
  return '\n'.join(lines)


def _fits(entry: dict[str, Any]) -> str:
  if not entry.get('fits', True):
    return 'does not fit'
  return fmt(entry.get('tokens_per_s'))


def _span(values: Sequence[float]) -> str:
  """'1.86x' or '1.43x-5.55x'."""
  lo, hi = f'{min(values):.2f}x', f'{max(values):.2f}x'
  return lo if lo == hi else f'{lo}-{hi}'


def paper_section(data: dict[str, Any], out_dir: pathlib.Path) -> str:
  """Predictions of the cost model beside the paper's figures."""
  paper = data['paper']
  key = f'{data["seq_len"]}x{data["batch"]}'
  fits = data['largest_fits'].get(key, {})
  throughput = data['throughput']
  sensitivity = data.get('sensitivity', [])
  speedups = [r['speedup_vs_zero_offload'] for r in sensitivity]
  fitting = [r for r in throughput if r['zero_offload'].get('fits', True)]
  batch_speedups = [r['speedup_vs_zero_offload'] for r in fitting]
  hw_tflops = max(r['superoffload']['hardware_tflops'] for r in throughput)
  model_tflops = max(r['superoffload']['model_tflops'] for r in throughput)
  claims = [
    [
      'largest model, SuperOffload (B params)',
      fmt(paper['largest_superoffload_b'], 'g'),
      fmt(fits.get('superoffload'), '.1f'),
    ],
    [
      'largest model, ZeRO-Offload (B params)',
      fmt(paper['largest_zero_offload_b'], 'g'),
      fmt(fits.get('zero_offload'), '.1f'),
    ],
    [
      'speedup over ZeRO-Offload',
      f'up to {paper["max_speedup_vs_zero_offload"]}x',
      f'{_span(batch_speedups)} at batch {data["batch"]} '
      f'({fmt(fitting[0]["params_b"], "g")}B-'
      f'{fmt(fitting[-1]["params_b"], "g")}B); '
      + (
        f'{_span(speedups)} over batches '
        f'{sensitivity[0]["batch"]}-{sensitivity[-1]["batch"]} '
        f'({sensitivity[0]["params_b"]}B)'
        if speedups
        else ''
      ),
    ],
    [
      'TFLOPS, one GH200',
      f'~{paper["tflops_one_gh200"]}',
      f'{hw_tflops:.0f} hardware / {model_tflops:.0f} model',
    ],
  ]
  for row in data.get('graceadam_check', []):
    claims.append(
      [
        f'GraceAdam step, {row["params"]} params (s)',
        f'{row["graceadam_s"]} (DeepSpeed CPU-Adam '
        f'{row["deepspeed_cpu_adam_s"]})',
        fmt(row['predicted_s'], '.3f'),
      ]
    )
  claims_table = markdown_table(
    ['claim', 'paper / blog', 'model prediction'], claims
  )
  tput_table = markdown_table(
    [
      'params (B)',
      'policy',
      'device Adam tok/s',
      'ZeRO-Offload tok/s',
      'SuperOffload tok/s',
      'speedup vs ZeRO',
    ],
    [
      [
        fmt(r['params_b'], 'g'),
        r['weights'],
        _fits(r['device_adam']),
        _fits(r['zero_offload']),
        _fits(r['superoffload']),
        f'{r["speedup_vs_zero_offload"]:.2f}x'
        if r['zero_offload'].get('fits', True)
        else '(n/a)',
      ]
      for r in throughput
    ],
  )

  fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
  ax = axes[0]
  labels = ['SuperOffload', 'ZeRO-Offload']
  paper_v = [paper['largest_superoffload_b'], paper['largest_zero_offload_b']]
  model_v = [fits.get('superoffload', 0), fits.get('zero_offload', 0)]
  for k, (vals, name) in enumerate(
    ((paper_v, 'paper'), (model_v, 'model prediction'))
  ):
    bars = ax.bar(
      [i + (k - 0.5) * 0.38 for i in range(2)], vals, 0.38, label=name
    )
    ax.bar_label(bars, fmt='%.1f', fontsize=8)
  ax.set_xticks(range(2), labels)
  ax.set_ylabel('largest trainable model (B params)')
  ax.set_title(f'Largest model on one GH200\n(seq x batch {key})')
  ax.legend()

  ax = axes[1]
  checks = data.get('graceadam_check', [])
  series = (
    ('GraceAdam (paper)', 'graceadam_s'),
    ('DeepSpeed CPU-Adam (paper)', 'deepspeed_cpu_adam_s'),
    ('model prediction', 'predicted_s'),
  )
  for k, (name, field) in enumerate(series):
    bars = ax.bar(
      [i + (k - 1) * 0.27 for i in range(len(checks))],
      [c[field] for c in checks],
      0.27,
      label=name,
    )
    ax.bar_label(bars, fmt='%.3f', fontsize=7)
  ax.set_xticks(range(len(checks)), [c['params'] for c in checks])
  ax.set_ylabel('host Adam step (s)')
  ax.set_title('Host Adam step\npublished vs predicted')
  ax.legend(fontsize=8)

  ax = axes[2]
  if sensitivity:
    ax.plot(
      [r['batch'] for r in sensitivity],
      speedups,
      'o-',
      label='model prediction',
    )
    batches = [r['batch'] for r in sensitivity]
    ax.set_xscale('log', base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_title(
      f'Speedup over ZeRO-Offload\n({sensitivity[0]["params_b"]}B params, '
      f'seq {sensitivity[0]["seq_len"]})'
    )
  ax.axhline(
    paper['max_speedup_vs_zero_offload'],
    color='tab:red',
    ls='--',
    label=f'paper: up to {paper["max_speedup_vs_zero_offload"]}x',
  )
  ax.set_xlabel('batch')
  ax.set_ylabel('speedup (x)')
  ax.legend()
  for a in axes:
    a.grid(True, axis='y', alpha=0.3)
  fig.suptitle(
    'MODEL PREDICTIONS of the cost model (no GH200 used) beside the paper'
  )
  fig.tight_layout()
  fig.savefig(out_dir / 'paper_predictions.png', dpi=110)
  plt.close(fig)
  hw = data.get('hardware', {})
  lines = [
    "## The planner's GH200 predictions vs the paper "
    '(`results/paper_predictions.json`)',
    '',
    f'**{data.get("kind", "model predictions")}**, {data.get("date", "?")}; '
    f'profile {hw.get("name", "?")}, sequence {data["seq_len"]}, batch '
    f'{data["batch"]}.',
    '',
    claims_table,
    '',
    tput_table,
    '',
    '![paper_predictions](paper_predictions.png)',
  ]
  return '\n'.join(lines)


def _source_line(records: Sequence[dict[str, Any]]) -> str:
  """Which code the runs used: commits and working-tree states."""
  sources = [r.get('source') or {} for r in records]
  commits = sorted({x['commit'][:7] for x in sources if x.get('commit')})
  states = {x.get('diff_sha1') for x in sources if x.get('commit')}
  if not commits:
    return ''
  changed = max((len(x.get('changed_files', [])) for x in sources), default=0)
  text = f'Code: commit {", ".join(commits)}'
  if changed:
    text += (
      f' plus uncommitted changes (up to {changed} files; '
      f'{len(states)} distinct working-tree state(s) over the runs)'
    )
  return text + '.'


def sweep_section(path: pathlib.Path, out_dir: pathlib.Path) -> str:
  """Tables and plots of one sweep JSONL file.

  Args:
    path: The JSONL file; its stem names the PNGs.
    out_dir: Where the PNGs go.

  Returns:
    The markdown section.
  """
  records = load_runs([path])
  rows = run_rows(records)
  ok = [r for r in rows if r['status'] == 'ok']
  stem = path.stem
  description = next(
    (r['description'] for r in records if r.get('description')), ''
  )
  lines = [f'## Sweep `{stem}`' + (f': {description}' if description else '')]
  lines += ['']
  passes = {r['repeat'] for r in rows}
  para = (
    f'From `{path}`: {len(rows)} runs, {len(ok)} ok'
    + (f', {len(passes)} passes over the grid' if len(passes) > 1 else '')
    + '. Median step time and tokens/s leave out step 0 (compilation); '
    'with several passes, a grid point shows the median over its passes. '
    'Bytes/param: parameters plus optimizer state resident in each memory '
    'kind (transient gradients and activations not counted).'
  )
  starts = sorted(r['started_at'] for r in rows if r['started_at'])
  if starts:
    para += f' Runs started {starts[0]} to {starts[-1]}.'
  srcs = sorted({str(r['summary_source']) for r in ok})
  para += f' Summaries from: {", ".join(srcs)}. ' + _source_line(records)
  lines.append(para.strip())
  names = {r['optimizer'] for r in rows}
  if {'superoffload', 'optax'} <= names:
    table, wins = comparison_table(rows)
    lines += [
      '',
      table,
      '',
      f'superoffload at least as fast as optax in {wins} setting(s).',
    ]
  lines += ['', sweep_table(rows)]
  failures = failure_table(rows)
  if failures:
    lines += ['', 'Failed or timed-out runs:', '', failures]
  if ok:
    plot_throughput(rows, out_dir / f'{stem}_throughput.png')
    plot_bytes(rows, out_dir / f'{stem}_bytes_per_param.png')
    lines += [
      '',
      f'![throughput]({stem}_throughput.png)',
      '',
      f'![bytes per param]({stem}_bytes_per_param.png)',
    ]
  return '\n'.join(lines)


def analyze(
  sweep_paths: Sequence[str | pathlib.Path],
  results_dir: str | pathlib.Path = 'results',
  out_dir: str | pathlib.Path = 'results/sweep',
) -> pathlib.Path:
  """Writes ``tables.md`` and the PNGs; returns the path of ``tables.md``.

  Args:
    sweep_paths: Sweep JSONL files (may be empty).
    results_dir: Folder with the benchmark JSONs; missing ones are skipped.
    out_dir: Where the tables and plots go.
  """
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  results_dir = pathlib.Path(results_dir)
  now = datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')
  parts = [
    '# Sweep and benchmark tables',
    '',
    f'Generated by `python -m experiments.analyze` at {now}.',
  ]
  for sweep_path in sweep_paths:
    parts += ['', sweep_section(pathlib.Path(sweep_path), out_dir)]
  sections = (
    ('bench_adam.json', bench_adam_section),
    ('bench_step.json', bench_step_section),
    ('paper_predictions.json', paper_section),
  )
  for name, section in sections:
    path = results_dir / name
    if path.exists():
      parts += ['', section(json.loads(path.read_text()), out_dir)]
    else:
      parts += ['', f'(`{path}` not found: section skipped.)']
  tables = out_dir / 'tables.md'
  tables.write_text('\n'.join(parts) + '\n')
  return tables


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point."""
  parser = argparse.ArgumentParser(
    prog='python -m experiments.analyze', description=__doc__.split('\n')[0]
  )
  parser.add_argument('sweeps', nargs='*', help='sweep JSONL files')
  parser.add_argument('--results-dir', default='results')
  parser.add_argument('--out-dir', default='results/sweep')
  args = parser.parse_args(argv)
  path = analyze(args.sweeps, args.results_dir, args.out_dir)
  print(path.read_text())
  return 0


if __name__ == '__main__':
  sys.exit(main())
