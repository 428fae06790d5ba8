"""The sandbox API of ``rollbox serve`` under attack: auth, scoping, size limits, policy, leaks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from rollbox import AsyncSandbox, Limits, NetworkConfig
from rollbox.errors import (
    CommandError,
    ConfigError,
    RollboxError,
    SandboxDeadError,
    SandboxFileError,
    SandboxStartError,
    TooManySandboxesError,
)
from rollbox.sandbox.remote import (
    CLIENT_HEADER,
    ERROR_CODES,
    ErrorInfo,
    RemoteProvider,
    error_code,
    exception_from,
)
from tests.conftest import assert_no_leftovers, live_leftovers
from tests.server.conftest import ServerProcess, running_server

TOKEN_A = "token-of-alice-0123456789abcdef"
TOKEN_B = "token-of-bob-0123456789abcdef00"


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerProcess]:
    """A server with two clients' tokens and small body limits."""
    with tempfile.NamedTemporaryFile("w", suffix=".tokens") as tokens:
        tokens.write(f"{TOKEN_A}\n{TOKEN_B}\n")
        tokens.flush()
        with running_server(
            "--token-file", tokens.name, "--max-upload-mb", "1", "--max-request-mb", "0.25",
            "--idle-timeout", "2",
        ) as server:  # fmt: skip
            server.token = TOKEN_A  # for stats()
            yield server


@pytest.fixture
async def alice(guarded: ServerProcess) -> AsyncIterator[RemoteProvider]:
    provider = RemoteProvider(guarded.url, TOKEN_A)
    yield provider
    await provider.close()


@pytest.fixture
async def bob(guarded: ServerProcess) -> AsyncIterator[RemoteProvider]:
    provider = RemoteProvider(guarded.url, TOKEN_B)
    yield provider
    await provider.close()


def test_refuses_to_listen_beyond_loopback_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ROLLBOX_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "rollbox", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "bearer token" in done.stderr and "ROLLBOX_TOKEN" in done.stderr
    assert "Traceback" not in done.stderr
    from rollbox.server import ServerConfig, create_app

    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        with pytest.raises(ConfigError, match="bearer token"):
            create_app(ServerConfig(host=host, env=None))
    with pytest.raises(ConfigError, match="at least 16"):
        create_app(ServerConfig(host="0.0.0.0", tokens=("short",), env=None))


async def test_requests_without_the_token_are_refused(guarded: ServerProcess) -> None:
    for headers in (
        {},
        {"Authorization": "Bearer wrong-token-0123456789abc"},
        {"Authorization": TOKEN_A},
    ):
        response = httpx.post(f"{guarded.url}/v1/sandboxes", json={"spec": {}}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # probes need no token
    assert guarded.stats()["sandboxes"] == 0
    with pytest.raises(ConfigError, match="bearer token"):
        await AsyncSandbox.create(provider=RemoteProvider(guarded.url, token="nope-nope-nope-nope"))


async def test_clients_cannot_see_or_touch_each_others_sandboxes(
    guarded: ServerProcess, alice: RemoteProvider, bob: RemoteProvider
) -> None:
    secret = await AsyncSandbox.create(provider=alice)
    await secret.files.write("/work/secret.txt", "alice's")
    assert await bob.list() == []  # no lease yet
    mine = await AsyncSandbox.create(provider=bob)
    assert [info.id for info in await bob.list()] == [mine.id]
    with pytest.raises(SandboxDeadError):
        await bob.get(secret.id)
    # Bob, with his own token and lease, addressing Alice's sandbox by id directly
    headers = {**guarded.headers(TOKEN_B), CLIENT_HEADER: bob._client_id or ""}
    base = f"{guarded.url}/v1/sandboxes/{secret.id}"
    async with httpx.AsyncClient(headers=headers) as http:
        attempts = [
            await http.get(base),
            await http.delete(base),
            await http.get(f"{base}/files", params={"path": "/work/secret.txt"}),
            await http.put(f"{base}/files", params={"path": "/work/x"}, content=b"x"),
            await http.get(f"{base}/dir", params={"path": "/work"}),
            await http.post(f"{base}/exec", json={"command": "cat secret.txt"}),
        ]
    assert [r.status_code for r in attempts] == [404] * len(attempts)
    assert {r.json()["error"]["code"] for r in attempts} == {"not_found"}
    # a second lease of the same token is a different client too
    alice_again = RemoteProvider(guarded.url, TOKEN_A)
    try:
        await AsyncSandbox.create(provider=alice_again)
        assert secret.id not in {info.id for info in await alice_again.list()}
        with pytest.raises(SandboxDeadError):
            await alice_again.get(secret.id)
    finally:
        await alice_again.close()
    assert secret.alive and await secret.files.read_text("/work/secret.txt") == "alice's"


async def test_http_episodes_are_scoped_to_their_token(guarded: ServerProcess) -> None:
    task = {"id": "t", "instruction": "anything", "max_turns": 3}
    reset = httpx.post(
        f"{guarded.url}/reset", json={"task": task}, headers=guarded.headers(TOKEN_A), timeout=30
    ).json()
    episode = reset["metadata"]["episode_id"]
    steal = httpx.post(
        f"{guarded.url}/step",
        json={"episode_id": episode, "action": {"tool": "bash", "command": "echo pwned"}},
        headers=guarded.headers(TOKEN_B),
        timeout=30,
    )
    assert steal.status_code == 404 and steal.json()["detail"]["code"] == "SESSION_ERROR"
    state = httpx.get(
        f"{guarded.url}/state", params={"episode_id": episode}, headers=guarded.headers(TOKEN_A)
    ).json()
    assert state["step_count"] == 0  # Bob's step never ran
    end = httpx.post(
        f"{guarded.url}/step",
        json={"episode_id": episode, "action": {"tool": "submit"}},
        headers=guarded.headers(TOKEN_A),
        timeout=30,
    ).json()
    assert end["done"] is True
    assert_no_leftovers({reset["metadata"]["sandbox_id"]})


async def test_body_limits_answer_413(guarded: ServerProcess, alice: RemoteProvider) -> None:
    async with await AsyncSandbox.create(provider=alice) as sandbox:
        await sandbox.files.write("/work/fits.bin", os.urandom(1024 * 1024 - 1))
        # the provider knows the server's limits and does not even send what is over them
        with pytest.raises(ConfigError, match=r"limit of 1048576 bytes.*--max-upload-mb"):
            await sandbox.files.write("/work/too-big.bin", os.urandom(1024 * 1024 + 1))
        with pytest.raises(ConfigError, match="--max-request-mb"):
            await sandbox.commands.run("wc -c", stdin=b"x" * 300_000)
        # the server refuses them from any client: declared, lied about, or chunked
        headers = {**guarded.headers(TOKEN_A), CLIENT_HEADER: alice._client_id or ""}
        url = f"{guarded.url}/v1/sandboxes/{sandbox.id}/files"
        async with httpx.AsyncClient(headers=headers, timeout=30) as http:
            over = await http.put(url, params={"path": "/work/big"}, content=b"y" * (1 << 20 | 1))
            assert over.status_code == 413, over.text
            assert "--max-upload-mb" in over.json()["error"]["message"]
            exec_url = f"{guarded.url}/v1/sandboxes/{sandbox.id}/exec"
            big_json = await http.post(
                exec_url, json={"command": "true", "env": {"X": "x" * 300_000}}
            )
            assert big_json.status_code == 413 and "--max-request-mb" in big_json.text
        assert not await sandbox.files.exists("/work/big")

        async def endless() -> AsyncIterator[bytes]:
            for _ in range(64):
                yield b"z" * 65536  # 4 MiB, chunked, no Content-Length

        async with httpx.AsyncClient(headers=headers) as http:
            chunked = await http.put(url, params={"path": "/work/chunked"}, content=endless())
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "too_large"
        assert not await sandbox.files.exists("/work/chunked")
        assert await sandbox.files.read("/work/fits.bin") != b""  # the sandbox is fine


async def test_oversized_websocket_messages_close_the_session(guarded: ServerProcess) -> None:
    import websockets

    url = guarded.ws_url + "/ws"
    async with websockets.connect(url, additional_headers=guarded.headers(TOKEN_A)) as ws:
        task = {"id": "big", "instruction": "x" * 300_000}  # over --max-request-mb 0.25
        await ws.send(json.dumps({"type": "reset", "data": {"task": task}}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # too big
    deadline = time.monotonic() + 10
    while guarded.stats()["sessions"]:
        assert time.monotonic() < deadline, "the session outlived its socket"
        await asyncio.sleep(0.05)
    assert guarded.stats()["sandboxes"] == 0


def test_a_bad_env_is_refused_at_start() -> None:
    for env, message in (
        ("no/Such-v0", "neither a registered env id"),
        ("json:nothing_here", "cannot load 'json:nothing_here'"),
        ("builtins:dict", "made a dict, not a rollbox env"),
        ("json:dumps", "making the env failed"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "rollbox", "serve", "--port", "0", "--env", env],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, (env, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


def alice_headers(provider: RemoteProvider) -> dict[str, str]:
    return {"Authorization": f"Bearer {provider.token}", CLIENT_HEADER: provider._client_id or ""}


async def test_server_policy_bounds_what_clients_ask(alice: RemoteProvider) -> None:
    with tempfile.TemporaryDirectory() as rootfs:
        (Path(rootfs) / "usr/bin").mkdir(parents=True)
        (Path(rootfs) / "usr/bin/python3").symlink_to(sys.executable)
        for template in ("/", rootfs):  # a path on the server's disk is never the client's pick
            with pytest.raises(ConfigError, match="not offered by this server"):
                await AsyncSandbox.create(from_template=template, provider=alice)
    # a snapshot is a directory on the server's disk: "/" would show the host's /work
    headers = {**alice_headers(alice)}
    snapshot = {
        "id": "snap-evil", "provider": "local", "template": "python", "template_id": "x",
        "source_sandbox": "sb-0", "created_at": "2026-01-01T00:00:00Z", "size_bytes": 0, "ref": "/",
    }  # fmt: skip
    async with httpx.AsyncClient(base_url=alice.url, headers=headers, timeout=30) as http:
        refused = await http.post("/v1/sandboxes", json={"spec": {"snapshot": snapshot}})
    assert refused.status_code in (400, 422), refused.text  # 422: a rollbox without snapshots
    assert refused.json()["error"]["code"] == "bad_request"
    with pytest.raises(ConfigError, match="no network"):
        await AsyncSandbox.create(network=NetworkConfig(allow_out=["1.1.1.1"]), provider=alice)
    with pytest.raises(ConfigError, match=r"limits\.memory_mb=100000 is above"):
        await AsyncSandbox.create(limits=Limits(memory_mb=100_000), provider=alice)
    with pytest.raises(ConfigError, match=r"ttl_seconds=1000000\.0 is above"):
        await AsyncSandbox.create(ttl_seconds=1e6, provider=alice)
    unbounded = await AsyncSandbox.create(ttl_seconds=None, provider=alice)  # clamped, not forever
    assert unbounded.info().expires_at is not None
    await unbounded.kill()
    assert await alice.list() == []


_VANISHING_CLIENT = """
import asyncio, json, sys
from rollbox import AsyncSandbox
from rollbox.sandbox.remote import RemoteProvider

async def main():
    provider = RemoteProvider(sys.argv[1], sys.argv[2])
    boxes = [await AsyncSandbox.create(provider=provider) for _ in range(3)]
    for box in boxes:
        await box.commands.spawn("sleep 1000")
    print(json.dumps([box.id for box in boxes]), flush=True)
    await asyncio.sleep(1000)

asyncio.run(main())
"""


def test_a_client_that_dies_leaves_nothing(guarded: ServerProcess) -> None:
    client = subprocess.Popen(
        [sys.executable, "-c", _VANISHING_CLIENT, guarded.url, TOKEN_A],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert client.stdout is not None
        ids = set(json.loads(client.stdout.readline()))
        assert len(ids) == 3 and guarded.stats()["sandboxes"] >= 3
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
        if client.stdout is not None:
            client.stdout.close()
    started = time.monotonic()
    stats = guarded.wait_until_idle()
    assert stats["sandboxes"] == 0 and stats["clients"] == 0, stats
    assert time.monotonic() - started < 10  # the lease closing did it, not an idle timeout
    assert_no_leftovers(ids)


async def test_a_dropped_exec_stream_kills_its_command(
    guarded: ServerProcess, alice: RemoteProvider
) -> None:
    async with await AsyncSandbox.create(provider=alice) as sandbox:
        headers = {**guarded.headers(TOKEN_A), CLIENT_HEADER: alice._client_id or ""}
        async with (
            httpx.AsyncClient(headers=headers, timeout=30) as http,
            http.stream(
                "POST",
                f"{guarded.url}/v1/sandboxes/{sandbox.id}/exec",
                json={"command": "sleep 777", "timeout_seconds": 600},
            ) as stream,
        ):
            lines = stream.aiter_lines()  # held: dropping it would close the stream already
            assert json.loads(await anext(lines))["event"] == "started"
            deadline = time.monotonic() + 10
            while "sleep 777" not in (await sandbox.commands.run("ps -eo args")).stdout:
                assert time.monotonic() < deadline, "the command did not start"
                await asyncio.sleep(0.02)
        # the client hung up mid-command
        deadline = time.monotonic() + 10
        while "sleep 777" in (await sandbox.commands.run("ps -eo args")).stdout:
            assert time.monotonic() < deadline, "the command outlived its client"
            await asyncio.sleep(0.05)


async def test_a_create_whose_client_gave_up_makes_no_sandbox(guarded: ServerProcess) -> None:
    provider = RemoteProvider(guarded.url, TOKEN_A, max_sandboxes=1)
    try:
        first = await AsyncSandbox.create(provider=provider)
        waiting = asyncio.ensure_future(AsyncSandbox.create(provider=provider))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # at the cap: the server holds the request
        waiting.cancel()  # the client gives up: its HTTP connection closes
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await first.kill()  # a slot frees: a create still pending on the server would take it
        await asyncio.sleep(0.5)
        assert await provider.list() == []
        assert guarded.stats()["sandboxes"] == 0
    finally:
        await provider.close()


async def test_lease_less_sandboxes_die_when_idle(guarded: ServerProcess) -> None:
    headers = guarded.headers(TOKEN_B)  # no lease: a curl user
    async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=30) as http:
        created = await http.post("/v1/sandboxes", json={"spec": {}})
        assert created.status_code == 200, created.text
        sandbox_id = created.json()["info"]["id"]
        ran = await http.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"command": "echo hi"})
        assert [json.loads(line)["event"] for line in ran.text.splitlines()] == ["started", "exit"]
        deadline = time.monotonic() + 20
        while any(sandbox_id in item for items in live_leftovers().values() for item in items):
            assert time.monotonic() < deadline, "an idle lease-less sandbox was not reaped"
            await asyncio.sleep(0.1)  # (not by asking the server: a request is activity)
        gone = await http.get(f"/v1/sandboxes/{sandbox_id}")
        assert gone.status_code in (404, 410) and gone.json()["error"]["code"] in (
            "not_found",
            "sandbox_dead",
        )
    assert_no_leftovers({sandbox_id})


_CREATE_AND_EXIT = """
import asyncio, sys
from rollbox import AsyncSandbox
from rollbox.sandbox.remote import RemoteProvider

async def main():
    provider = RemoteProvider(sys.argv[1])
    for _ in range(2):
        await AsyncSandbox.create(provider=provider)  # never killed, provider never closed

asyncio.run(main())
"""


def test_sigterm_kills_every_sandbox_of_the_server() -> None:
    server = ServerProcess()
    done = subprocess.run(
        [sys.executable, "-c", _CREATE_AND_EXIT, server.url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # that client exited without cleaning up: its lease closed and its sandboxes went with it
    assert server.wait_until_idle()["sandboxes"] == 0
    # a lease-less sandbox, alive when the operator stops the server
    created = httpx.post(f"{server.url}/v1/sandboxes", json={"spec": {}}, timeout=30).json()
    assert server.stats()["sandboxes"] == 1
    server.stop()  # SIGTERM; stop() asserts that no record of the server's sandboxes is left
    assert_no_leftovers({created["info"]["id"]})


def test_every_error_code_round_trips_to_its_exception_class() -> None:
    raised = [
        TooManySandboxesError("x"),
        SandboxStartError("x"),
        SandboxDeadError("x", sandbox_id="sb-1"),
        SandboxFileError("x"),
        CommandError("x"),
        ConfigError("x"),
    ]
    for exc in raised:
        code = error_code(exc)
        again = exception_from(ErrorInfo(code=code, message="x", sandbox_id="sb-1"))  # type: ignore[arg-type]
        assert type(again) is type(exc), (exc, code, again)
    assert error_code(RollboxError("x")) == "internal"
    assert set(ERROR_CODES) == set(ErrorInfo.model_fields["code"].annotation.__args__)  # type: ignore[union-attr]
