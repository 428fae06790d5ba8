"""Harbor tasks on rollbox: what a trial costs, against a baseline measured in the same run.

    python bench/harbor.py [--trials 20] [--tasks tests/integrations/harbor_tasks]
                           [--harbor-python /path/to/python3.12-with-harbor]

Measured, each as the median over ``--trials``:

- baseline: the bare sandbox lifecycle on the local backend (create from the ``python``
  template, run ``true``, kill);
- a rollbox trial of each task: ``run_rollouts`` with Harbor's ``oracle`` (sandbox from the
  task's template, ``solve.sh``, ``test.sh`` and the reward file, kill), one at a time, and the
  throughput with 4 at once;
- Harbor's own trials on rollbox (``harbor run -e rollbox.integrations.harbor:RollboxEnvironment``,
  when a Python with harbor is given): the phase times Harbor records in each trial's result.

Harbor's Docker environment needs ``docker compose`` and a registry for the task images; on a
machine that has them, compare with ``harbor run -e docker`` on the same tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

from rollbox import AsyncSandbox
from rollbox.envs.harbor import HarborDataset, OracleAgent, read_harbor_tasks
from rollbox.runner import run_rollouts
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.templates import build_local

ROOT = Path(__file__).resolve().parents[1]
CHEAP = ("shell-count", "hidden-tests")


async def bare_lifecycle(provider: LocalProvider, trials: int) -> list[float]:
    times = []
    for _ in range(trials):
        started = time.perf_counter()
        async with await AsyncSandbox.create(provider=provider) as sandbox:
            await sandbox.commands.run("true")
        times.append(time.perf_counter() - started)
    return times


async def rollbox_trials(
    provider: LocalProvider, tasks: list, trials: int, concurrent: int
) -> tuple[list[float], float]:
    """Per-trial seconds (as each Rollout records them) and trials per second."""
    copies = [
        dataclasses.replace(task, id=f"{task.id}#{i}") for i in range(trials) for task in tasks
    ]
    started = time.perf_counter()
    rollouts = await run_rollouts(
        HarborDataset(copies),
        OracleAgent(),
        provider=provider,
        score_in_agent_sandbox=True,
        n_concurrent=concurrent,
    )
    wall = time.perf_counter() - started
    bad = [r for r in rollouts if r.score != 1.0]
    if bad:
        raise SystemExit(f"the oracle failed: {bad[0]}")
    return [r.duration_s for r in rollouts], len(rollouts) / wall


def harbor_trials(python: str, tasks_dir: Path, trials: int) -> dict[str, list[float]]:
    """Harbor's own phase times for ``trials`` oracle trials per cheap task, on rollbox."""
    harbor = Path(python).parent / "harbor"
    with tempfile.TemporaryDirectory(prefix="rollbox-bench-harbor-") as scratch:
        jobs = Path(scratch) / "jobs"
        command = [
            str(harbor), "run", "-p", str(tasks_dir), "-a", "oracle", "-k", str(trials),
            "-n", "1", "-e", "rollbox.integrations.harbor:RollboxEnvironment",
            "-o", str(jobs), "--job-name", "bench", "-y", "-q",
        ]  # fmt: skip
        for name in sorted(p.name for p in tasks_dir.iterdir() if p.is_dir()):
            if name not in CHEAP:
                command += ["-x", name]
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        subprocess.run(command, cwd=scratch, env=env, check=True, capture_output=True)
        phases: dict[str, list[float]] = {
            "environment start": [],
            "agent": [],
            "verifier": [],
            "whole trial": [],
        }
        for result in jobs.glob("bench/*/result.json"):
            trial = json.loads(result.read_text())
            if (trial.get("verifier_result") or {}).get("rewards", {}).get("reward") != 1:
                raise SystemExit(f"a Harbor trial failed: {result}")
            for phase, key in (
                ("environment start", "environment_setup"),
                ("agent", "agent_execution"),
                ("verifier", "verifier"),
                ("whole trial", None),
            ):
                timing = trial[key] if key else trial
                phases[phase].append(_seconds(timing["started_at"], timing["finished_at"]))
        return phases


def _seconds(start: str, end: str) -> float:
    parse = datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--tasks", type=Path, default=ROOT / "tests/integrations/harbor_tasks")
    parser.add_argument("--harbor-python", default=os.environ.get("ROLLBOX_HARBOR_PYTHON"))
    args = parser.parse_args()
    tasks = [t for t in read_harbor_tasks(args.tasks) if t.path.name in CHEAP]
    for task in tasks:  # built once, before anything is timed
        build_local(task.template("local"))

    async def measure() -> tuple[list[float], list[float], float, float]:
        provider = LocalProvider()
        try:
            await bare_lifecycle(provider, 3)  # warm up
            baseline = await bare_lifecycle(provider, args.trials)
            single, _ = await rollbox_trials(provider, tasks, args.trials, 1)
            _, rate_1 = await rollbox_trials(provider, tasks, args.trials, 1)
            _, rate_4 = await rollbox_trials(provider, tasks, args.trials, 4)
            return baseline, single, rate_1, rate_4
        finally:
            await provider.close()

    baseline, single, rate_1, rate_4 = asyncio.run(measure())
    base = statistics.median(baseline)
    print(f"{'what':<42}{'median ms':>10}{'p90 ms':>9}{'vs baseline':>13}")

    def row(what: str, values: list[float]) -> None:
        median = statistics.median(values)
        p90 = sorted(values)[int(0.9 * (len(values) - 1))]
        print(f"{what:<42}{median * 1000:>10.1f}{p90 * 1000:>9.1f}{median / base:>12.2f}x")

    row("baseline: sandbox create + true + kill", baseline)
    row(f"rollbox trial, oracle ({len(tasks)} tasks)", single)
    print(f"rollbox trials/s: {rate_1:.1f} one at a time, {rate_4:.1f} with 4 at once")
    if args.harbor_python:
        for phase, values in harbor_trials(args.harbor_python, args.tasks, args.trials).items():
            row(f"harbor run on rollbox: {phase}", values)
    else:
        print("(give --harbor-python or ROLLBOX_HARBOR_PYTHON to time Harbor's own trials)")


if __name__ == "__main__":
    main()
