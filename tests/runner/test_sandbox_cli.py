"""``rollbox sandbox create|exec|ls|kill``: a sandbox that outlives the command that made it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rollbox.sandbox import _host
from rollbox.sandbox.local import LocalProvider
from tests.conftest import assert_no_leftovers, reap_until_clean


def rollbox_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        input=stdin,
    )


def _create(*args: str) -> dict[str, object]:
    result = rollbox_cli("sandbox", "create", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_create_exec_ls_kill(tmp_path: Path) -> None:
    info = _create("--name", "shell", "--memory-mb", "128")
    sandbox_id = str(info["id"])
    try:
        assert info["limits"]["memory_mb"] == 128  # type: ignore[index]
        # state survives between commands: the same sandbox, from separate processes
        assert rollbox_cli("sandbox", "exec", sandbox_id, "echo 42 > n.txt").returncode == 0
        result = rollbox_cli(
            "sandbox",
            "exec",
            sandbox_id,
            "--",
            "python3",
            "-c",
            "print(open('n.txt').read().strip(), end='')",
        )
        assert (result.returncode, result.stdout) == (0, "42")
        failing = rollbox_cli("sandbox", "exec", sandbox_id, "echo oops >&2; exit 3")
        assert (failing.returncode, failing.stderr) == (3, "oops\n")
        slow = rollbox_cli("sandbox", "exec", "--timeout", "0.5", sandbox_id, "sleep 10")
        assert slow.returncode == 124 and "timed out" in slow.stderr
        piped = rollbox_cli("sandbox", "exec", "--stdin", sandbox_id, "wc -c", stdin="abc")
        assert piped.stdout.strip() == "3"
        assert not Path("/work/n.txt").exists()  # in the sandbox, not on the host

        listing = rollbox_cli("sandbox", "ls", "--json")
        rows = {row["id"]: row for row in json.loads(listing.stdout)}
        assert rows[sandbox_id]["held"] is True and rows[sandbox_id]["name"] == "shell"
        assert sandbox_id in rollbox_cli("sandbox", "ls").stdout

        killed = rollbox_cli("sandbox", "kill", sandbox_id)
        assert killed.returncode == 0 and f"killed {sandbox_id}" in killed.stdout
    finally:
        rollbox_cli("sandbox", "kill", sandbox_id)
    _wait_gone(sandbox_id)
    after = rollbox_cli("sandbox", "exec", sandbox_id, "true")
    assert after.returncode == 1 and f"no sandbox {sandbox_id}" in after.stderr
    assert sandbox_id not in rollbox_cli("sandbox", "ls").stdout


def test_the_ttl_ends_a_held_sandbox() -> None:
    sandbox_id = str(_create("--ttl", "1")["id"])
    _wait_gone(sandbox_id, timeout=20)
    assert not (_host.state_dir() / "held" / f"{sandbox_id}.sock").exists()


def test_a_holder_killed_with_9_is_reaped_by_cleanup() -> None:
    info = _create()
    sandbox_id, holder = str(info["id"]), int(info["holder_pid"])  # type: ignore[call-overload]
    os.kill(holder, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _host.process_start_time(holder) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    reap_until_clean({sandbox_id})
    result = rollbox_cli("sandbox", "exec", sandbox_id, "true")
    assert result.returncode == 1 and "no sandbox" in result.stderr


def test_bad_sandbox_arguments() -> None:
    result = rollbox_cli("sandbox", "exec", "not-an-id", "true")
    assert result.returncode == 2 and "is not a sandbox id" in result.stderr
    result = rollbox_cli("sandbox", "create", "--memory-mb", "0")
    assert result.returncode == 2 and "--memory-mb" in result.stderr
    result = rollbox_cli("sandbox", "kill")
    assert result.returncode == 2 and "give sandbox ids" in result.stderr


def _wait_gone(sandbox_id: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not (LocalProvider.state_path() / f"{sandbox_id}.json").exists():
            break
        time.sleep(0.05)
    assert_no_leftovers({sandbox_id})
