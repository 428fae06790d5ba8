"""Run rollbox's NeMo Gym integration in NeMo Gym's own Python (3.13) from the test suite's.

NeMo Gym needs Python >= 3.13; the suite runs on 3.11. The server and the driver
(``nemo_gym_driver.py``) run as subprocesses of the interpreter named by
``ROLLBOX_NEMO_GYM_PYTHON`` (default ``/work/venv313/bin/python``); ``.ci/run`` builds it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollbox.sandbox import _host

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("nemo_gym_driver.py")
EXAMPLE_DATA = REPO / "examples" / "nemo_gym" / "data" / "example.jsonl"
SERVER_DIR = REPO / "examples" / "nemo_gym" / "resources_servers" / "rollbox"  # ng_run's cwd
DEFAULT_PYTHON = "/work/venv313/bin/python"


def nemo_gym_python() -> str:
    """The interpreter with nemo-gym and rollbox; skip (fail in CI) if there is none."""
    python = os.environ.get("ROLLBOX_NEMO_GYM_PYTHON", DEFAULT_PYTHON)
    problem = None
    if not Path(python).is_file():
        problem = f"{python} does not exist"
    else:
        probe = subprocess.run(
            [python, "-c", "import nemo_gym, rollbox.integrations.nemo_gym"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if probe.returncode != 0:
            problem = f"{python} cannot import nemo_gym and rollbox: {probe.stderr.strip()[-500:]}"
    if problem is None:
        return python
    reason = (
        f"the NeMo Gym tests need a Python 3.13 venv with nemo-gym and rollbox: {problem}. "
        "Build it as .ci/run does, or point ROLLBOX_NEMO_GYM_PYTHON at one"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def drive(python: str, command: str, spec: dict[str, Any], *, timeout: float = 90) -> Any:
    """Run one driver command in NeMo Gym's Python; its printed JSON."""
    done = subprocess.run(
        [python, str(DRIVER), command, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert done.returncode == 0, f"driver {command} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Server:
    """A rollbox resources server process, started the way its NeMo Gym config says."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def sandbox_ids(self) -> set[str]:
        """The live sandboxes this server process owns, from rollbox's state records."""
        owned = set()
        for path in (_host.state_dir() / "sandboxes").glob("*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record.get("owner_pid") == self.process.pid:
                owned.add(record["id"])
        return owned

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)


def write_config(directory: Path, **settings: Any) -> Path:
    """A NeMo Gym config with one rollbox resources server."""
    lines = [
        "rollbox_test:",
        "  resources_servers:",
        "    rollbox:",
        "      entrypoint: app.py",
        "      domain: coding",
        "      verified: false",
        "      description: rollbox tests",
    ]
    lines += [f"      {key}: {json.dumps(value)}" for key, value in settings.items()]
    path = directory / "rollbox_test.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_server(python: str, config: Path, log: Path, *, as_ng_run: bool = False) -> Server:
    """Start the server with ``python -m rollbox.integrations.nemo_gym serve``, or, with
    ``as_ng_run``, as ``ng_run`` does: the example's ``app.py`` run in its directory, with the
    resolved config in the environment."""
    port = free_port()
    command = [python, "-m", "rollbox.integrations.nemo_gym", "serve", str(config)]
    command += ["--port", str(port)]
    cwd, env = REPO, None
    if as_ng_run:
        resolve = (
            "import json, sys; from rollbox.integrations.nemo_gym import server_environment; "
            "print(json.dumps(server_environment(sys.argv[1], port=int(sys.argv[2]))))"
        )
        done = subprocess.run(
            [python, "-c", resolve, str(config), str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        env = {**os.environ, **json.loads(done.stdout.strip().splitlines()[-1])}
        command, cwd = [python, "app.py"], SERVER_DIR
    handle = log.open("wb")
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    handle.close()
    server = Server(process, port, log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"the server exited with {process.returncode}:\n{server.log_text()}"
            )
        try:
            if httpx.get(f"{server.url}/", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"the server did not answer within 90 s:\n{server.log_text()}")


def example_rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in EXAMPLE_DATA.read_text().splitlines() if line.strip()]


def row_for(task: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A dataset row as the ``dataset`` command writes it (the tools are filled by the server's
    tests only where they matter)."""
    return {
        "task_id": task["id"],
        "responses_create_params": {"input": [{"role": "user", "content": task["instruction"]}]},
        "task": task,
        **fields,
    }


def answer_task(task_id: str = "answer", expected: str = "42", **fields: Any) -> dict[str, Any]:
    """Solved by writing ``expected`` to /work/answer.txt; the hidden test compares it."""
    task: dict[str, Any] = {
        "id": task_id,
        "instruction": f"Write {expected} to /work/answer.txt.",
        "verifier": {
            "command": 'sh "$TESTS_DIR/check.sh"',
            "files": {"check.sh": f'test "$(cat /work/answer.txt)" = "{expected}"\n'},
        },
        "max_turns": 20,
        "step_timeout_seconds": 10,
    }
    task.update(fields)
    return task


def wait_until_gone(sandbox_ids: set[str], timeout: float = 20) -> None:
    """Wait until no cgroup or record of these sandboxes is left (a kill finishes in the
    background after the HTTP answer)."""
    from tests.conftest import live_leftovers

    deadline = time.monotonic() + timeout
    while True:
        left = {
            kind: [item for item in items if any(i in item for i in sandbox_ids)]
            for kind, items in live_leftovers().items()
            if kind != "bwrap"
        }
        left = {kind: items for kind, items in left.items() if items}
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"sandboxes left behind: {left}")
        time.sleep(0.1)
