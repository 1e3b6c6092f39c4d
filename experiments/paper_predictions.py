"""MODEL PREDICTIONS of SuperOffload at paper scale on one GH200.

Nothing here is measured: every number comes from the cost model of the
planner (`jax_superoffload._src.planning.planner`, whose docstring lists each
formula and assumption) evaluated on the built-in `GH200` profile, and is
printed beside the figures the SuperOffload paper and blog report.

  python -m experiments.paper_predictions [--seq-len 4096] [--batch 8]

Writes `experiments/paper_predictions.md` and `results/paper_predictions.json`
(or `--md` / `--out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.report import fmt
from experiments.report import markdown_table
from experiments.report import plt
from experiments.report import ticker
from jax_superoffload._src.planning import hardware
from jax_superoffload._src.planning import planner

HW = hardware.GH200
SIZES_B = (1, 2, 4, 8, 13, 20, 25)
# Batches for the sensitivity of the speedup (tokens per step matter most).
SENSITIVITY_BATCHES = (1, 2, 4, 8, 16)
SENSITIVITY_SIZE_B = 13
# Low-precision moment formats (`plan(moments=...)`), predicted without STV:
# the library does not combine them with STV yet.
LOWP_MOMENTS = ('bf16', '8bit')
# Scan for the largest model that fits, in billions of parameters.
SCAN_B = np.round(np.arange(0.5, 60.0 + 1e-9, 0.1), 1)
# (name, what the paper or its blog reports); from the project notes.
PAPER = {
  'largest_superoffload_b': 25,
  'largest_zero_offload_b': 15,
  'max_speedup_vs_zero_offload': 2.5,
  'tflops_one_gh200': 600,
  'gpu_utilisation': '~50% (ZeRO-Offload) to over 80% (SuperOffload)',
  'graceadam_s': {'1B': 0.082, '8B': 0.608},
  'deepspeed_cpu_adam_s': {'1B': 0.098, '8B': 0.769},
}
HEADER = (
  '> **These are MODEL PREDICTIONS of our cost model '
  '(`superoffload.plan`), not measurements.** No GH200 was used. The '
  'paper columns are the figures SuperOffload (arXiv 2509.21271) and its '
  'blog report, quoted for comparison.'
)


def spec(params_b: float, seq_len: int, batch: int) -> planner.ModelSpec:
  return planner.ModelSpec.from_params(
    params_b * 1e9, seq_len=seq_len, batch=batch
  )


def largest_fits(seq_len: int, batch: int) -> dict[str, float]:
  """Largest scanned size (B params) that fits, per system.

  SuperOffload with exact STV (clipping or NaN skipping armed, the paper's
  setting), and without it.
  """
  best = {
    'device_adam': 0.0,
    'zero_offload': 0.0,
    'superoffload': 0.0,
    'superoffload_no_stv': 0.0,
  }
  best.update({f'superoffload_{m}_no_stv': 0.0 for m in LOWP_MOMENTS})
  for size in SCAN_B:
    model = spec(size, seq_len, batch)
    p = planner.plan(model, HW, moments='fp32')
    fits = {
      'device_adam': p.device_adam.fits,
      'zero_offload': p.zero_offload.fits,
      'superoffload': p.fits,
      'superoffload_no_stv': planner.plan(
        model, HW, stv=False, moments='fp32'
      ).fits,
    }
    for m in LOWP_MOMENTS:
      fits[f'superoffload_{m}_no_stv'] = planner.plan(
        model, HW, stv=False, moments=m
      ).fits
    for name, fit in fits.items():
      if fit:
        best[name] = float(size)
  return best


def _system(est: planner.Estimate | planner.Plan, recompute: float) -> dict:
  return {
    'fits': est.fits,
    'step_time_s': est.step_time_s,
    'tokens_per_s': est.tokens_per_s,
    'model_tflops': est.tflops,
    'hardware_tflops': est.tflops * recompute,
    'device_busy_fraction': est.device_busy_fraction,
    'device_gb': est.device_bytes / 1e9,
    'host_gb': est.host_bytes / 1e9,
  }


def throughput_row(params_b: float, seq_len: int, batch: int) -> dict:
  p = planner.plan(spec(params_b, seq_len, batch), HW, moments='fp32')
  recompute = 8 / 6 if p.model.activation_checkpointing else 1.0
  zero = p.zero_offload
  return {
    'params_b': params_b,
    'layers': p.model.layers,
    'hidden': p.model.hidden,
    'seq_len': seq_len,
    'batch': batch,
    'weights': p.weights,
    'cast': p.cast,
    'bucket_elements': p.bucket_elements,
    'device_buckets': p.device_buckets,
    'bucket_count': p.bucket_count,
    'device_adam': _system(p.device_adam, recompute),
    'zero_offload': _system(zero, recompute),
    'superoffload': _system(p, recompute),
    'speedup_vs_zero_offload': zero.step_time_s / p.step_time_s,
  }


def graceadam_check() -> list[dict]:
  """Predicted host Adam step vs the published GraceAdam timings."""
  rows = []
  for label, n in (('1B', 1e9), ('8B', 8e9)):
    predicted = n * hardware.ADAM_BYTES_PER_PARAM / HW.host_adam_bytes_per_s
    published = PAPER['graceadam_s'][label]
    rows.append(
      {
        'params': label,
        'predicted_s': predicted,
        'graceadam_s': published,
        'deepspeed_cpu_adam_s': PAPER['deepspeed_cpu_adam_s'][label],
        'predicted_over_published': predicted / published,
      }
    )
  return rows


def _span(values: list[float], fmt: str) -> str:
  lo, hi = fmt.format(min(values)), fmt.format(max(values))
  return lo if lo == hi else f'{lo} to {hi}'


def cast_sensitivity(seq_len: int) -> list[dict]:
  rows = []
  for gbs in (40.0, 120.0, HW.host_adam_bytes_per_s / 1e9):
    hw = dataclasses.replace(HW, host_cast_gbs=gbs)
    for batch in (1, 8):
      p = planner.plan(
        spec(SENSITIVITY_SIZE_B, seq_len, batch), hw, moments='fp32'
      )
      rows.append(
        {
          'host_cast_gbs': gbs,
          'batch': batch,
          'cast': p.cast,
          'speedup_vs_zero_offload': p.zero_offload.step_time_s / p.step_time_s,
        }
      )
  return rows


def _cell(system: dict, key: str, fmt: str) -> str:
  if not system['fits']:
    return f'does not fit ({system["device_gb"]:.0f} GB dev)'
  return format(system[key], fmt)


def markdown(result: dict) -> str:
  seq, batch = result['seq_len'], result['batch']
  fit = result['largest_fits'][f'{seq}x{batch}']
  rows = result['throughput']
  both = [r for r in rows if r['zero_offload']['fits']]
  so_busy = [r['superoffload']['device_busy_fraction'] for r in rows]
  zero_busy = [r['zero_offload']['device_busy_fraction'] for r in both]
  sens = result['sensitivity']
  sens_zero = [s['zero_offload']['device_busy_fraction'] for s in sens]
  sens_so = [s['superoffload']['device_busy_fraction'] for s in sens]
  out = [
    '# SuperOffload at paper scale on one GH200: model predictions',
    '',
    HEADER,
    '',
    f'Hardware profile: {HW.name}; {HW.device_peak_tflops:.0f} TFLOPS bf16 '
    f'peak at an assumed MFU of {HW.device_mfu}; host Adam at '
    f'{HW.host_adam_bytes_per_s / 1e9:.0f} GB/s '
    f'({HW.host_bandwidth_gbs:.0f} GB/s LPDDR5X x {HW.host_adam_efficiency}); '
    f'link {HW.link_bytes_per_s / 1e9:.0f} GB/s each way; host cast '
    f'{HW.host_cast_gbs:.0f} GB/s. GPT-shaped models (layers = hidden / 128, '
    f'vocab 32000), sequence {seq}, batch {batch}, activation checkpointing, '
    'flash attention. Model TFLOPS = 6NT / step; hardware TFLOPS add the '
    'recomputed forward (8NT / step).',
    '',
    '## Headline claims',
    '',
    '| claim | paper / blog | model prediction |',
    '|---|---|---|',
    '| largest model, one GH200, SuperOffload (exact STV armed) | '
    f'~{PAPER["largest_superoffload_b"]}B | {fit["superoffload"]:.1f}B |',
    '| largest model, one GH200, SuperOffload without STV | (not given) | '
    f'{fit["superoffload_no_stv"]:.1f}B |',
    '| largest model, one GH200, ZeRO-Offload | '
    f'~{PAPER["largest_zero_offload_b"]}B | {fit["zero_offload"]:.1f}B |',
    f'| largest model, one GH200, device-resident Adam | (not given) '
    f'| {fit["device_adam"]:.1f}B |',
    '| largest model, one GH200, SuperOffload without STV, bf16 moments | '
    f'(not given) | {fit["superoffload_bf16_no_stv"]:.1f}B '
    f'({fit["superoffload_bf16_no_stv"] / fit["superoffload_no_stv"]:.2f}x '
    'fp32 moments) |',
    '| largest model, one GH200, SuperOffload without STV, 8-bit moments | '
    f'(not given) | {fit["superoffload_8bit_no_stv"]:.1f}B '
    f'({fit["superoffload_8bit_no_stv"] / fit["superoffload_no_stv"]:.2f}x '
    'fp32 moments) |',
    '| speedup over ZeRO-Offload | '
    f'up to {PAPER["max_speedup_vs_zero_offload"]}x | '
    f'{_span([r["speedup_vs_zero_offload"] for r in both], "{:.2f}x")} at '
    f'batch {batch}; '
    f'{_span([s["speedup_vs_zero_offload"] for s in sens], "{:.2f}x")} over '
    f'batches {min(SENSITIVITY_BATCHES)}-{max(SENSITIVITY_BATCHES)} '
    f'({SENSITIVITY_SIZE_B}B) |',
    f'| TFLOPS on one GH200 | ~{PAPER["tflops_one_gh200"]} | '
    f'{max(r["superoffload"]["hardware_tflops"] for r in rows):.0f} hardware'
    f' ({max(r["superoffload"]["model_tflops"] for r in rows):.0f} model) |',
    f'| GPU utilisation | {PAPER["gpu_utilisation"]} | ZeRO-Offload-style '
    f'{_span(zero_busy, "{:.0%}")}, SuperOffload {_span(so_busy, "{:.0%}")}'
    f' at batch {batch}; {_span(sens_zero, "{:.0%}")} and '
    f'{_span(sens_so, "{:.0%}")} over batches '
    f'{min(SENSITIVITY_BATCHES)}-{max(SENSITIVITY_BATCHES)} (accelerator '
    'busy fraction) |',
    '',
    'Largest model that fits, by sequence x batch (B params; device Adam / '
    'ZeRO-Offload-style / SuperOffload with exact STV / without STV / '
    'without STV with bf16 moments / with 8-bit moments):',
    '',
  ]
  for key, f in result['largest_fits'].items():
    out.append(
      f'- {key}: {f["device_adam"]:.1f} / {f["zero_offload"]:.1f} / '
      f'{f["superoffload"]:.1f} / {f["superoffload_no_stv"]:.1f} / '
      f'{f.get("superoffload_bf16_no_stv", 0):.1f} / '
      f'{f.get("superoffload_8bit_no_stv", 0):.1f}'
    )
  out += [
    '',
    f'## Throughput, sequence {seq}, batch {batch}',
    '',
    '| params | SuperOffload policy | device Adam tok/s | ZeRO-Offload '
    'tok/s | SuperOffload tok/s | SuperOffload TFLOPS (hw / model) | '
    'busy ZeRO / SO | speedup vs ZeRO |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    so, zero, dev = r['superoffload'], r['zero_offload'], r['device_adam']
    speedup = (
      f'{r["speedup_vs_zero_offload"]:.2f}x' if zero['fits'] else '(n/a)'
    )
    out.append(
      f'| {r["params_b"]}B | {r["weights"]}, cast {r["cast"]}, '
      f'{r["device_buckets"]}/{r["bucket_count"]} buckets on device | '
      f'{_cell(dev, "tokens_per_s", ",.0f")} | '
      f'{_cell(zero, "tokens_per_s", ",.0f")} | '
      f'{_cell(so, "tokens_per_s", ",.0f")} | '
      f'{so["hardware_tflops"]:.0f} / {so["model_tflops"]:.0f} | '
      f'{zero["device_busy_fraction"]:.0%} / '
      f'{so["device_busy_fraction"]:.0%} | {speedup} |'
    )
  out += [
    '',
    f'## Speedup over ZeRO-Offload-style vs batch ({SENSITIVITY_SIZE_B}B, '
    f'sequence {seq})',
    '',
    '| batch | ZeRO-Offload tok/s | SuperOffload tok/s | busy ZeRO / SO | '
    'speedup |',
    '|---|---|---|---|---|',
  ]
  for s in sens:
    zero, so = s['zero_offload'], s['superoffload']
    out.append(
      f'| {s["batch"]} | {zero["tokens_per_s"]:,.0f} | '
      f'{so["tokens_per_s"]:,.0f} | {zero["device_busy_fraction"]:.0%} / '
      f'{so["device_busy_fraction"]:.0%} | '
      f'{s["speedup_vs_zero_offload"]:.2f}x |'
    )
  out += [
    '',
    f'## Speedup over ZeRO-Offload-style vs host cast rate '
    f'({SENSITIVITY_SIZE_B}B, sequence {seq})',
    '',
    'The baseline pays for bf16<->fp32 casts on the host; how fast those are '
    'is the least certain input (we assume ~1/100 of the GPU rate, as the '
    'paper reports).',
    '',
    '| host cast GB/s | batch | speedup |',
    '|---|---|---|',
  ]
  for c in result['cast_sensitivity']:
    out.append(
      f'| {c["host_cast_gbs"]:.0f} | {c["batch"]} | '
      f'{c["speedup_vs_zero_offload"]:.2f}x |'
    )
  out += [
    '',
    '## Host Adam cross-check (one step)',
    '',
    '| params | predicted | GraceAdam (published) | DeepSpeed CPU-Adam '
    '(published) | predicted / GraceAdam |',
    '|---|---|---|---|---|',
  ]
  for g in result['graceadam_check']:
    out.append(
      f'| {g["params"]} | {g["predicted_s"]:.3f} s | {g["graceadam_s"]} s | '
      f'{g["deepspeed_cpu_adam_s"]} s | {g["predicted_over_published"]:.2f} |'
    )
  out += ['', '## Caveats', '']
  out += [f'- {c}' for c in result['caveats']]
  return '\n'.join(out) + '\n'


CAVEATS = [
  'The host Adam efficiency (0.74 of 500 GB/s) is calibrated on the '
  "published 8B GraceAdam step, so that row's agreement is by construction; "
  'the 1B row is the check.',
  'The ZeRO-Offload-style baseline is our model of it (serial, bf16 over '
  'the link, host casts at ~1/100 of the GPU rate, the same Adam kernel), '
  'not DeepSpeed. At a fixed batch every term of both models scales with '
  'the parameter count, so the speedup is the same at every size; it grows '
  'as the batch shrinks (host work stops hiding under compute) and falls '
  'as host casts get faster, spanning the paper\'s "up to 2.5x".',
  'SuperOffload is predicted to keep the accelerator busy 100% of the step '
  'at batch 8 (the blog reports over 80%): per-bucket and launch overheads, '
  'allocator stalls and imperfect overlap are not modelled.',
  'The largest SuperOffload model is bound by host memory on Grace after a '
  '10% reserve: 28 B/param with exact STV (fp32 master, m and v, their '
  'spare rows, and the kept fp32 gradients), 16 B/param without STV. The '
  "paper's ~25B matches the 16 B/param layout; its rollback of a clipped "
  'step is not exact. The ZeRO-Offload limit is bound by device '
  'memory (4 B/param + activations), and both move with the batch and '
  'sequence through the activations.',
  'MFU 0.6 is an assumption for all accelerator work; attention score '
  'FLOPs are not counted; kernel launch, per-bucket and synchronisation '
  'overheads are ignored, so predictions are optimistic for small models.',
]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--seq-len', type=int, default=4096)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--md', default='experiments/paper_predictions.md')
  parser.add_argument('--out', default='results/paper_predictions.json')
  args = parser.parse_args()
  seq, batch = args.seq_len, args.batch
  fit_configs = sorted({(2048, 4), (4096, 1), (4096, 8), (seq, batch)})
  result = {
    'kind': 'MODEL PREDICTIONS (cost model, not measurements)',
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'hardware': dataclasses.asdict(HW),
    'seq_len': seq,
    'batch': batch,
    'paper': PAPER,
    'largest_fits': {f'{s}x{b}': largest_fits(s, b) for s, b in fit_configs},
    'throughput': [throughput_row(n, seq, batch) for n in SIZES_B],
    'sensitivity': [
      throughput_row(SENSITIVITY_SIZE_B, seq, b) for b in SENSITIVITY_BATCHES
    ],
    'cast_sensitivity': cast_sensitivity(seq),
    'graceadam_check': graceadam_check(),
    'caveats': CAVEATS,
  }
  text = markdown(result)
  print(text)
  pathlib.Path(args.md).write_text(text)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + '\n')
  print(f'wrote {args.md} and {out}')


def _fits(entry: dict[str, Any]) -> str:
  if not entry.get('fits', True):
    return 'does not fit'
  return fmt(entry.get('tokens_per_s'))


def _value_span(values: Sequence[float]) -> str:
  """'1.86x' or '1.43x-5.55x'."""
  lo, hi = f'{min(values):.2f}x', f'{max(values):.2f}x'
  return lo if lo == hi else f'{lo}-{hi}'


def report(data: dict[str, Any], out_dir: pathlib.Path) -> str:
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
      f'{_value_span(batch_speedups)} at batch {data["batch"]} '
      f'({fmt(fitting[0]["params_b"], "g")}B-'
      f'{fmt(fitting[-1]["params_b"], "g")}B); '
      + (
        f'{_value_span(speedups)} over batches '
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


if __name__ == '__main__':
  main()
