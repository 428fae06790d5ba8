"""Network: a default sandbox has its own loopback and nothing else."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from _attack_helpers import assert_answers, assert_no_leftovers, new_sandbox, sh

CONNECT = r"""
import errno, json, socket, sys
out = {}
def attempt(label, family, kind, address):
    sock = socket.socket(family, kind)
    sock.settimeout(3)
    try:
        sock.connect(address)
        if kind == socket.SOCK_DGRAM:
            sock.send(b"x")
            sock.recv(1)
        out[label] = "CONNECTED"
    except OSError as exc:
        out[label] = errno.errorcode.get(exc.errno, type(exc).__name__)
    finally:
        sock.close()
port, abstract = int(sys.argv[1]), sys.argv[2]
attempt("internet tcp", socket.AF_INET, socket.SOCK_STREAM, ("1.1.1.1", 80))
attempt("internet udp dns", socket.AF_INET, socket.SOCK_DGRAM, ("8.8.8.8", 53))
attempt("internet ipv6", socket.AF_INET6, socket.SOCK_STREAM, ("2606:4700:4700::1111", 80))
attempt("host loopback", socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", port))
attempt("host abstract unix", socket.AF_UNIX, socket.SOCK_STREAM, "\0" + abstract)
try:
    socket.getaddrinfo("example.com", 80)
    out["dns"] = "RESOLVED"
except OSError as exc:
    out["dns"] = type(exc).__name__
print(json.dumps(out))
"""


@pytest.fixture
def host_listeners() -> Iterator[tuple[int, str, list[str]]]:
    """A TCP listener on the host's 127.0.0.1 and an abstract unix socket, recording any
    connection they accept."""
    accepted: list[str] = []
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    abstract_name = f"rollbox-test-{secrets.token_hex(6)}"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind("\0" + abstract_name)
    unix.listen()
    stop = threading.Event()

    def serve(server: socket.socket, label: str) -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(label)
            connection.close()

    threads = [
        threading.Thread(target=serve, args=(tcp, "tcp"), daemon=True),
        threading.Thread(target=serve, args=(unix, "unix"), daemon=True),
    ]
    for thread in threads:
        thread.start()
    yield tcp.getsockname()[1], abstract_name, accepted
    stop.set()
    for thread in threads:
        thread.join(5)
    tcp.close()
    unix.close()


async def test_no_egress_no_host_services_no_dns(
    provider: object, host_listeners: tuple[int, str, list[str]]
) -> None:
    port, abstract_name, accepted = host_listeners
    # The listeners work from the host itself: a refusal below is the sandbox's doing.
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect("\0" + abstract_name)
    probe.close()
    for _ in range(250):
        if len(accepted) >= 2:
            break
        time.sleep(0.02)
    assert sorted(accepted) == ["tcp", "unix"]
    accepted.clear()

    sb = await new_sandbox(provider)
    result = await sh(sb, f"python3 - {port} {abstract_name}", stdin=CONNECT)
    outcome = json.loads(result.stdout)
    # No route out of the sandbox's own network namespace at all: ENETUNREACH, not a timeout
    # that a slow firewall could also produce.
    assert outcome["internet tcp"] == "ENETUNREACH", outcome
    assert outcome["internet udp dns"] == "ENETUNREACH", outcome
    assert outcome["internet ipv6"] in ("ENETUNREACH", "EADDRNOTAVAIL"), outcome
    # The host's loopback is not the sandbox's loopback, and abstract unix sockets (X11, dbus,
    # ...) are per network namespace.
    assert outcome["host loopback"] == "ECONNREFUSED", outcome
    assert outcome["host abstract unix"] == "ECONNREFUSED", outcome
    assert outcome["dns"] == "gaierror", outcome
    assert accepted == []  # the host listeners never saw a connection

    # The shell tools agree.
    for command in [
        "getent hosts example.com",
        "curl -sS --max-time 3 http://1.1.1.1/",
        f"curl -sS --max-time 3 http://127.0.0.1:{port}/",
    ]:
        tool = await sh(sb, command)
        assert tool.exit_code != 0, (command, tool)
    assert accepted == []
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_only_loopback_exists(provider: object) -> None:
    sb = await new_sandbox(provider)
    interfaces = await sh(sb, "ls /sys/class/net 2>/dev/null || tail -n +3 /proc/net/dev")
    names = {line.split(":")[0].strip() for line in interfaces.stdout.splitlines() if line.strip()}
    assert names == {"lo"}, interfaces
    routes = await sh(sb, "cat /proc/net/route")
    assert len(routes.stdout.strip().splitlines()) == 1, routes  # the header line only
    # The sandbox's own loopback does work (servers talking to their own tests need it).
    loop = await sh(
        sb,
        'python3 -c \'import socket; s = socket.create_server(("127.0.0.1", 0)); '
        'c = socket.create_connection(s.getsockname()); print("ok")\'',
    )
    assert loop.stdout == "ok\n", loop
    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_sandbox_listener_is_not_reachable_from_the_host(provider: object) -> None:
    """The other direction: a server in the sandbox is not a port on the host."""
    with socket.socket() as free:  # a port nothing on the host listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    sb = await new_sandbox(provider)
    server = await sb.commands.spawn(
        f'python3 -c \'import socket, time; s = socket.create_server(("127.0.0.1", {port})); '
        'print("listening", flush=True); time.sleep(30)\''
    )
    for _ in range(250):
        if "listening" in (await server.logs())[0]:
            break
        await asyncio.sleep(0.02)
    assert "listening" in (await server.logs())[0]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    await server.kill()
    await sb.kill()
    assert_no_leftovers({sb.id})
