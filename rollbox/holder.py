"""Sandboxes that outlive the command that made them, for ``rollbox sandbox create|exec|ls|kill``.

A local sandbox dies with the process that owns it. ``rollbox sandbox create`` therefore starts
a detached holder process (``python -m rollbox.holder``) that creates the sandbox, owns it, and
serves ``exec``, ``info`` and ``kill`` on a unix socket in the state directory (mode 0600: only
its user may connect). The holder exits, and the sandbox with it, on ``kill``, when the TTL
runs out, or on SIGTERM/SIGINT/SIGHUP; if it is killed with -9, bwrap dies with it and
``rollbox cleanup`` reaps the rest, as for any crashed owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from rollbox.errors import ConfigError, SandboxDeadError, SandboxStartError
from rollbox.sandbox import _host
from rollbox.sandbox.models import SandboxSpec

_READY_TIMEOUT_S = 60.0
_MESSAGE_LIMIT = 64 * 1024 * 1024


def held_dir() -> Path:
    """Where holder sockets live: one ``<sandbox id>.sock`` per held sandbox."""
    return _host.state_dir() / "held"


def socket_path(sandbox_id: str) -> Path:
    if not sandbox_id.startswith("sb-") or not sandbox_id[3:].isalnum():
        raise ConfigError(f"{sandbox_id!r} is not a sandbox id (they look like sb-1a2b3c4d5e6f)")
    return held_dir() / f"{sandbox_id}.sock"


def start(spec: SandboxSpec) -> dict[str, Any]:
    """Start a holder with a new sandbox; returns the sandbox's info once it is up.

    Raises:
        SandboxStartError: the holder or its sandbox did not come up (with its error).
    """
    held_dir().mkdir(parents=True, exist_ok=True)
    os.chmod(held_dir(), 0o700)
    holder = subprocess.Popen(
        [sys.executable, "-m", "rollbox.holder"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C in the terminal that ran `create` does not reach it
        cwd="/",
    )
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write(spec.model_dump_json().encode())
    holder.stdin.close()
    try:
        line, _ = _read_line(holder, _READY_TIMEOUT_S)
    except BaseException:
        holder.kill()
        holder.wait()
        raise
    if not line:
        holder.wait(timeout=10)
        error = holder.stderr.read().decode(errors="replace").strip() if holder.stderr else ""
        raise SandboxStartError(f"the sandbox holder exited: {error[-2000:] or 'no reason given'}")
    holder.stdout.close()
    if holder.stderr is not None:
        holder.stderr.close()
    reply = json.loads(line)
    if "error" in reply:
        holder.wait(timeout=10)
        raise SandboxStartError(reply["error"])
    return reply["info"]


def _read_line(process: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, None]:
    assert process.stdout is not None
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise SandboxStartError(f"the sandbox holder did not answer within {timeout:.0f} s")
    return process.stdout.readline(), None


def request(sandbox_id: str, message: dict[str, Any], timeout: float | None = None) -> Any:
    """Send one request to the holder of ``sandbox_id`` and return its reply.

    Raises:
        SandboxDeadError: no holder serves that sandbox (never created here, killed, expired).
    """
    path = socket_path(sandbox_id)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.settimeout(timeout)
        try:
            client.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            with contextlib.suppress(OSError):
                if path.exists():
                    path.unlink()  # its holder died without cleaning up
            raise SandboxDeadError(
                f"no sandbox {sandbox_id} held by `rollbox sandbox create` is alive (see "
                "`rollbox sandbox ls`)",
                sandbox_id=sandbox_id,
            ) from None
        client.sendall(json.dumps(message).encode() + b"\n")
        data = bytearray()
        while not data.endswith(b"\n"):
            chunk = client.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    finally:
        client.close()
    if not data:
        raise SandboxDeadError(
            f"sandbox {sandbox_id} died during the request", sandbox_id=sandbox_id
        )
    reply = json.loads(data)
    if "error" in reply:
        kind = reply.get("kind")
        error = SandboxDeadError if kind == "dead" else ConfigError if kind == "config" else None
        if error is None:
            from rollbox.errors import CommandError

            raise CommandError(reply["error"], sandbox_id=sandbox_id)
        if error is SandboxDeadError:
            raise SandboxDeadError(reply["error"], sandbox_id=sandbox_id)
        raise ConfigError(reply["error"])
    return reply["ok"]


def held_ids() -> set[str]:
    """Ids of sandboxes whose holder socket exists."""
    directory = held_dir()
    return {p.stem for p in directory.glob("sb-*.sock")} if directory.is_dir() else set()


# -- the holder process ----------------------------------------------------------------------


async def _serve(spec: SandboxSpec) -> None:
    from rollbox import AsyncSandbox
    from rollbox.sandbox.local import LocalProvider

    try:
        sandbox = await AsyncSandbox.create(
            spec.name,
            provider=LocalProvider(pool_size=0),  # it holds one sandbox: none booted ahead
            from_template=spec.template,
            network=spec.network,
            limits=spec.limits,
            env_vars=spec.env_vars,
            ttl_seconds=spec.ttl_seconds,
        )
    except Exception as exc:
        _tell_parent({"error": f"{type(exc).__name__}: {exc}"})
        return
    path = socket_path(sandbox.id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(signum, stop.set)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            reply = await _answer(sandbox, json.loads(line), stop)
        except Exception as exc:
            reply = {"error": f"bad request: {exc}", "kind": "config"}
        with contextlib.suppress(ConnectionError):
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
            writer.close()

    try:
        old_umask = os.umask(0o177)
        try:
            server = await asyncio.start_unix_server(handle, path=str(path), limit=_MESSAGE_LIMIT)
        finally:
            os.umask(old_umask)
        info = json.loads(sandbox.info().model_dump_json())
        info.update(holder_pid=os.getpid(), limits=spec.limits.model_dump())
        _tell_parent({"info": info})
        async with server:
            while not stop.is_set() and sandbox.alive:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        await sandbox.kill()


async def _answer(sandbox: Any, message: dict[str, Any], stop: asyncio.Event) -> dict[str, Any]:
    from rollbox.errors import CommandError

    op = message.get("op")
    if op == "info":
        return {"ok": json.loads(sandbox.info().model_dump_json())}
    if op == "kill":
        stop.set()
        return {"ok": True}
    if op == "exec":
        try:
            result = await sandbox.commands.run(
                message["command"],
                cwd=message.get("cwd", "/work"),
                timeout_seconds=message.get("timeout"),
                env=message.get("env") or None,
                stdin=message.get("stdin"),
            )
        except SandboxDeadError as exc:
            return {"error": str(exc), "kind": "dead"}
        except CommandError as exc:
            return {"error": str(exc), "kind": "command"}
        except ConfigError as exc:
            return {"error": str(exc), "kind": "config"}
        return {"ok": result.model_dump()}
    return {"error": f"unknown op {op!r}", "kind": "config"}


def _tell_parent(message: dict[str, Any]) -> None:
    """The one line ``start`` waits for; then stdout is closed and the holder runs on alone."""
    with contextlib.suppress(OSError):
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (1, 2):
            os.dup2(null, fd)
        os.close(null)


def main() -> None:
    spec = SandboxSpec.model_validate_json(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    asyncio.run(_serve(spec))


if __name__ == "__main__":
    main()
