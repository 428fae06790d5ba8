"""A real ``rollbox serve`` on loopback, started as a subprocess, and checks that it left nothing."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from rollbox.sandbox import _host

pytest.importorskip("fastapi", reason="the server tests need pip install 'rollbox[server]'")


class ServerProcess:
    """``python -m rollbox serve --port 0 ARGS`` until ``stop()``."""

    def __init__(self, *args: str, token: str | None = None, cwd: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("ROLLBOX_TOKEN", "ROLLBOX_URL")}
        if token is not None:
            env["ROLLBOX_TOKEN"] = token
        self.token = token
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollbox", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=cwd,
        )
        assert self.proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        line = ""
        if selector.select(timeout=60):
            line = self.proc.stdout.readline()
        selector.close()
        if "listening on " not in line:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"rollbox serve did not start: {line!r}\n{self.logs()}")
        self.url = line.split("listening on ", 1)[1].split()[0]

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://")

    def headers(self, token: str | None = None) -> dict[str, str]:
        token = token or self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def stats(self) -> dict[str, int]:
        response = httpx.get(f"{self.url}/v1/stats", headers=self.headers(), timeout=10)
        response.raise_for_status()
        return response.json()

    def wait_until_idle(self, timeout: float = 20.0) -> dict[str, int]:
        """Wait until the server holds no sandbox and no session; return its stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["sandboxes"] == 0 and stats["sessions"] == 0:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def records(self) -> list[str]:
        """State records of sandboxes this server owns."""
        found = []
        for path in (_host.state_dir() / "sandboxes").glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                if json.loads(path.read_text())["owner_pid"] == self.proc.pid:
                    found.append(path.stem)
        return found

    def stop(self) -> None:
        """SIGTERM, as an operator would; the server must kill every sandbox it made."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"rollbox serve ignored SIGTERM\n{self.logs()}") from None
        assert self.records() == [], f"the server left sandboxes behind: {self.records()}"
        logs = self.logs()
        assert "Traceback" not in logs, f"the server hit an unhandled error:\n{logs}"
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


@contextlib.contextmanager
def running_server(*args: str, token: str | None = None) -> Iterator[ServerProcess]:
    server = ServerProcess(*args, token=token)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One default server for the tests that do not need special settings."""
    with running_server("--max-sessions", "16") as started:
        yield started
