"""The ``rollbox`` command, run for real as a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import rollbox
from rollbox.sandbox import _host

# Every feature doctor must report, in its order.
FEATURES = [
    "root",
    "bwrap",
    "user namespaces",
    "namespaces",
    "cgroup memory",
    "cgroup pids",
    "cgroup cpu",
    "overlayfs",
    "seccomp",
    "python template",
    "state dir",
    "netns",
    "ip",
    "nft",
    "fast cgroup moves",
    "end-to-end",
]


def rollbox_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_version() -> None:
    for argv in (["-m", "rollbox.cli"], ["-m", "rollbox"]):
        result = subprocess.run(
            [sys.executable, *argv, "--version"], capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"rollbox {rollbox.__version__}"


def test_doctor_reports_every_feature() -> None:
    result = rollbox_cli("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for feature in FEATURES:
        assert any(re.match(rf"  (OK|MISSING|SKIPPED) +{feature}  ", line) for line in lines), (
            f"doctor did not report {feature!r}:\n{result.stdout}"
        )
    assert "the local backend is usable" in result.stdout
    assert re.search(r"  OK +end-to-end +created sb-[0-9a-f]+ in \d+ ms", result.stdout)


def test_doctor_json() -> None:
    result = rollbox_cli("doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["rollbox"] == rollbox.__version__
    assert report["usable"] is True
    assert [check["name"] for check in report["checks"]] == FEATURES
    for check in report["checks"]:
        assert check["status"] in ("ok", "missing", "skipped")
        assert check["ok"] == (check["status"] == "ok")
        assert check["detail"]
        if check["required"]:
            assert check["ok"], check
        if check["status"] == "missing":
            assert check["impact"] and check["fix"], check
    # Every probe is real but quick: the whole doctor, a real sandbox included.
    assert report["elapsed_ms"] < 2000


def test_doctor_exits_1_and_names_the_fix_when_the_backend_is_unusable() -> None:
    result = rollbox_cli("doctor", "--json", env={"ROLLBOX_STATE_DIR": "/dev/null/rollbox"})
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["usable"] is False
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["state dir"]["status"] == "missing"
    assert "ROLLBOX_STATE_DIR" in checks["state dir"]["fix"]
    assert checks["end-to-end"]["status"] == "missing"


def test_demo_scores_candidates() -> None:
    result = rollbox_cli("demo", "--json", "--n-concurrent", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    rows = {(row["task"], row["candidate"]): row for row in report["results"]}
    assert report["sandboxes"] == len(rows) >= 12
    assert report["as_expected"] is True
    for (_, candidate), row in rows.items():
        assert row["reward"] == (1.0 if candidate == "correct" else 0.0), row
    assert {task for task, _ in rows} == {"add", "reverse", "fizzbuzz", "is_prime"}
    assert rows["add", "crashes"]["result"].startswith("exit 1: NameError")
    assert "No such file" in rows["reverse", "reads-host-file"]["result"]
    assert rows["fizzbuzz", "loops-forever"]["result"].startswith("timeout")
    assert rows["is_prime", "fork-bomb"]["result"].startswith("timeout")
    assert rows["add", "wrong"]["result"] == "exit 0"  # a wrong answer, not a crash
    assert report["sandboxes_per_s"] > 0


def test_demo_prints_a_table() -> None:
    result = rollbox_cli("demo", "--timeout", "0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^add +correct +1\.0 +exit 0 +\d+$", result.stdout, re.M)
    assert re.search(r"^add +wrong +0\.0 +exit 0 +\d+$", result.stdout, re.M)
    assert re.search(r"^fizzbuzz +loops-forever +0\.0 +timeout \(0\.5 s\)", result.stdout, re.M)
    assert re.search(r"12 sandboxes in [\d.]+ s wall, [\d.]+ sandboxes/s", result.stdout)
    assert "every reward is as expected" in result.stdout


def test_cleanup_reaps_what_a_crashed_process_left() -> None:
    crash = textwrap.dedent(
        """
        import asyncio, os, signal
        from rollbox import AsyncSandbox

        async def main():
            box = await AsyncSandbox.create(ttl_seconds=600)
            print(box.id, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # die without any cleanup

        asyncio.run(main())
        """
    )
    # Not a private ROLLBOX_STATE_DIR: cgroups are machine-wide, and a provider with another
    # state dir takes every sandbox it has no record of for a leftover. So another process's
    # LocalProvider may reap our crashed sandbox before we do; then try again.
    for _ in range(3):
        crashed = subprocess.run(
            [sys.executable, "-c", crash], capture_output=True, text=True, timeout=60
        )
        assert crashed.returncode == -9, crashed.stderr
        sandbox_id = crashed.stdout.strip()
        assert sandbox_id.startswith("sb-")
        record = _host.state_dir() / "sandboxes" / f"{sandbox_id}.json"

        result = rollbox_cli("cleanup")
        assert result.returncode == 0, result.stderr
        match = re.fullmatch(
            r"reaped (\d+) sandbox(es)?( \(.*\))? left by dead processes or past their TTL; "
            r"(\d+) still live \(owned by running processes\)\n",
            result.stdout,
        )
        assert match, result.stdout
        assert not record.exists()
        layout = _host.cgroup_layout()
        assert layout is not None
        assert not any((parent / sandbox_id).exists() for parent in layout.parents.values())
        if sandbox_id in result.stdout:
            assert int(match[1]) >= 1
            return
    pytest.fail("another process reaped the crashed sandbox first, three times")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--n-concurrent", "0"], "argument --n-concurrent: must be a whole number >= 1"),
        (["demo", "--timeout", "soon"], "argument --timeout: must be a number of seconds > 0"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: command"),
        (["doctor", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_argument_exits_2_with_one_line(argv: list[str], message: str) -> None:
    result = rollbox_cli(*argv)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert message in result.stderr
    assert "--help" in result.stderr


def test_failure_is_one_line_exit_1() -> None:
    result = rollbox_cli("demo", env={"ROLLBOX_STATE_DIR": "/dev/null/rollbox"})
    assert result.returncode == 1
    assert result.stderr.startswith("rollbox demo: error: ")
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
