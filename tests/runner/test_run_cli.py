"""``rollbox run`` as a real process: results, Ctrl-C, kill -9 and resume, no sandbox left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rollbox.sandbox.local import LocalProvider
from tests.conftest import assert_no_leftovers

REPO = Path(__file__).resolve().parents[2]
DATASET = "tests.runner.fixtures:dataset"
AGENT = "tests.runner.fixtures:agent"


def _start(out: Path, log: Path, *, n: int, seconds: float, env: dict[str, str] | None = None):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollbox.cli",
            "run",
            "--dataset",
            DATASET,
            "--agent",
            AGENT,
            "--out",
            str(out),
            "--n-concurrent",
            "2",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "ROLLBOX_TEST_LOG": str(log),
            "ROLLBOX_TEST_N": str(n),
            "ROLLBOX_TEST_SECONDS": str(seconds),
            **(env or {}),
        },
    )


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_results(path: Path, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(_lines(path)) < count:
        assert time.monotonic() < deadline, "no results came"
        time.sleep(0.05)


def _sandboxes(log: Path) -> set[str]:
    return {line.split()[1] for line in log.read_text().splitlines()} if log.exists() else set()


def test_run_writes_results_and_a_summary(tmp_path: Path) -> None:
    out, log = tmp_path / "x", tmp_path / "log"
    done = _start(out, log, n=4, seconds=0)
    stdout, stderr = done.communicate(timeout=120)
    assert done.returncode == 0, stderr
    rows = _lines(out / "results.jsonl")
    assert sorted(r["instance_id"] for r in rows) == ["q0", "q1", "q2", "q3"]
    assert all(r["resolved"] is True and r["score"] == 1.0 for r in rows)
    assert "resolved             4  100.0%" in stdout and "errors               0" in stdout
    assert "run [" in stderr and "pass 100.0%" in stderr
    record = json.loads((out / "run.json").read_text())
    assert record["dataset"] == DATASET and record["summary"]["resolved"] == 4
    assert record["template_ids"][0].startswith("python:")
    assert record["sandboxes"][0]["limits"]["memory_mb"] == 256
    assert_no_leftovers(_sandboxes(log))


def test_ctrl_c_keeps_finished_results_and_leaves_no_sandbox(tmp_path: Path) -> None:
    out, log = tmp_path / "x", tmp_path / "log"
    run = _start(out, log, n=20, seconds=1.0)
    _wait_for_results(out / "results.jsonl", 2)
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stderr
    assert "rollbox run: interrupted" in stderr
    finished = _lines(out / "results.jsonl")  # every line whole
    assert 2 <= len(finished) < 20 and all(r["resolved"] for r in finished)
    assert_no_leftovers(_sandboxes(log))


def test_kill_9_loses_no_result_and_a_second_run_finishes_the_rest(tmp_path: Path) -> None:
    # a state directory of its own, so that only our reaper finds what the killed run left
    # (under /run: the sandbox user must reach the agent file it holds)
    state = Path(f"/run/rollbox-test-run-{os.getpid()}")
    env = {"ROLLBOX_STATE_DIR": str(state)}
    out, log = tmp_path / "x", tmp_path / "log"
    run = _start(out, log, n=10, seconds=0.5, env=env)
    _wait_for_results(out / "results.jsonl", 3)
    run.kill()
    run.communicate(timeout=30)
    before = {r["instance_id"] for r in _lines(out / "results.jsonl")}
    assert len(before) >= 3
    assert all(r["resolved"] for r in _lines(out / "results.jsonl"))
    calls_before = len(log.read_text().splitlines())

    os.environ["ROLLBOX_STATE_DIR"] = str(state)
    try:
        LocalProvider().cleanup()  # the reaper: what the killed run left is gone
        assert_no_leftovers(_sandboxes(log))
    finally:
        del os.environ["ROLLBOX_STATE_DIR"]

    second = _start(out, log, n=10, seconds=0, env=env)
    stdout, stderr = second.communicate(timeout=120)
    assert second.returncode == 0, stderr
    assert f"({len(before)} done earlier)" in stdout
    rerun = [line.split()[0] for line in log.read_text().splitlines()[calls_before:]]
    assert not set(rerun) & before  # what was done was not run again
    final = {r["instance_id"]: r for r in _lines(out / "results.jsonl")}
    assert sorted(final) == [f"q{i}" for i in range(10)]
    assert all(r["resolved"] for r in final.values())
    assert_no_leftovers(_sandboxes(log))
    subprocess.run(["rm", "-rf", str(state)], check=True)


def test_bad_dataset_spec_is_one_line(tmp_path: Path) -> None:
    for spec, message in (
        ("nosuchmodule:dataset", "cannot import nosuchmodule"),
        ("tests.runner.fixtures:nothing", "has no 'nothing'"),
        ("tests.runner.fixtures", "expected pkg.module:attr"),
    ):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollbox.cli",
                "run",
                "--dataset",
                spec,
                "--agent",
                AGENT,
                "--out",
                str(tmp_path / "x"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
