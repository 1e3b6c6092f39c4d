"""The sweep's report: tables and plots of `experiments.sweeps.sweep` results.

Reads the sweep JSONL files (the last record of each run id wins) and turns
them into a markdown section with a per-run table, a superoffload-vs-optax
comparison and two plots.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

from experiments.sweeps.report import fmt
from experiments.sweeps.report import markdown_table
from experiments.sweeps.report import plt
from experiments.sweeps.report import ticker

# Plot order and colours of the sweep's optimizers; others follow.
OPTIMIZER_ORDER = ('superoffload', 'optax', 'device')
COLORS = {
  'superoffload': 'tab:blue',
  'optax': 'tab:orange',
  'device': 'tab:green',
}


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


def report(path: pathlib.Path, out_dir: pathlib.Path) -> str:
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
