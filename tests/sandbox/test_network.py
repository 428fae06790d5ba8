"""NetworkConfig(allow_out=...) on the local backend, against a real "test host" in its own netns.

The test host is a network namespace made here, joined to the host by a veth pair, with a tiny
TCP server in it (``ip netns exec``). Nothing leaves the machine.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from rollbox import AsyncSandbox
from rollbox.errors import BackendUnavailableError
from rollbox.sandbox import _host, _netns
from rollbox.sandbox.models import NetworkConfig

pytestmark = [
    pytest.mark.network,
    pytest.mark.skipif(os.geteuid() != 0, reason="sandbox networks need root"),
    pytest.mark.skipif(
        not (
            shutil.which("ip", path=_netns._SEARCH_PATH)
            and shutil.which("nft", path=_netns._SEARCH_PATH)
        ),
        reason="needs `ip` and `nft`: apt-get install iproute2 nftables",
    ),
]

PORT_A, PORT_B = 8701, 8702
_SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    def serve(port):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(16)
        ready.release()
        while True:
            c, _ = s.accept()
            c.sendall(b"hello %d\\n" % port)
            c.close()
    ports = [int(p) for p in sys.argv[1:]]
    ready = threading.Semaphore(0)
    for port in ports:
        threading.Thread(target=serve, args=(port,), daemon=True).start()
    for _ in ports:
        ready.acquire()
    print("ready", flush=True)
    sys.stdin.read()
    """
)
_PROBE = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((sys.argv[1], int(sys.argv[2])))
        print("OK", s.recv(100).decode().strip())
    except socket.timeout:
        print("ERR timeout")
    except OSError as e:
        print("ERR", e.errno)
    """
)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 for the test host that overlaps neither a host route nor rollbox's pool."""
    taken = [*_netns._route_networks(), _netns.pool()]
    for _ in range(1000):
        subnet = ipaddress.IPv4Network(
            (f"10.250.{random.randrange(256)}.{4 * random.randrange(64)}", 30)
        )
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise RuntimeError("no free test subnet")


@dataclass
class NetHost:
    netns: str
    veth: str
    address: str  # the test host, in its namespace
    host_address: str  # the host's end of the test veth (an address of the host itself)


@pytest.fixture(scope="module")
def test_host() -> Iterator[NetHost]:
    """A namespace reachable from the host over a veth, serving TCP on PORT_A and PORT_B."""
    tag = secrets.token_hex(3)
    netns, veth = f"rbxtest-{tag}", f"rbt{tag}"
    subnet = _free_subnet()
    host_address, address = str(subnet.network_address + 1), str(subnet.network_address + 2)
    server: subprocess.Popen[str] | None = None
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("addr", "add", f"{host_address}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("-n", netns, "addr", "add", f"{address}/30", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        server = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", _SERVER, str(PORT_A), str(PORT_B)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield NetHost(netns, veth, address, host_address)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", netns, check=False)


@pytest.fixture
def host_services() -> Iterator[int]:
    """A TCP service of the host itself on every address (loopback included); yields its port."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen(16)
    accepted: list[object] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.sendall(b"host secret\n")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
    assert not accepted, "a sandbox reached a host service"


async def _probe(box: AsyncSandbox, address: str, port: int) -> str:
    result = await box.commands.run(f"python3 -c '{_PROBE}' {address} {port}")
    assert result.exit_code == 0, result
    return result.stdout.strip()


async def _interfaces(box: AsyncSandbox) -> list[str]:
    lines = (await box.files.read_text("/proc/net/dev")).splitlines()[2:]
    return sorted(line.split(":")[0].strip() for line in lines)


def _leftovers_of(sandbox_id: str) -> dict[str, list[str]]:
    net = _netns.SandboxNet(sandbox_id)
    found = {
        k: [n for n in v if n in (net.netns, net.veth, net.table)]
        for k, v in _netns.leftovers().items()
    }
    leases = _netns._dir() / "leases"
    found["leases"] = [
        p.name
        for p in (leases.iterdir() if leases.is_dir() else ())
        if (_netns._read_lease(p) or {}).get("id") == sandbox_id
    ]
    return {k: v for k, v in found.items() if v}


async def test_allowed_cidr_reaches_test_host(provider, test_host: NetHost) -> None:
    network = NetworkConfig(allow_out=[f"{test_host.address}/32"])
    async with await AsyncSandbox.create(provider=provider, network=network) as box:
        assert await _probe(box, test_host.address, PORT_A) == f"OK hello {PORT_A}"
        assert await _probe(box, test_host.address, PORT_B) == f"OK hello {PORT_B}"
        assert await _interfaces(box) == ["eth0", "lo"]
        assert (await box.commands.run("id -u")).stdout.strip() == str(_host.SANDBOX_UID)


async def test_reaper_leaves_live_networks_alone(
    provider, test_host: NetHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    network = NetworkConfig(allow_out=[f"{test_host.address}/32"])
    async with await AsyncSandbox.create(provider=provider, network=network) as box:
        # as a process with another ROLLBOX_STATE_DIR would: sandbox networks are machine-wide
        monkeypatch.setenv("ROLLBOX_STATE_DIR", "/nonexistent/rollbox")
        _netns.reap()
        monkeypatch.undo()
        assert set(_leftovers_of(box.id)) == {"netns", "veth", "nft", "leases"}
        assert await _probe(box, test_host.address, PORT_A) == f"OK hello {PORT_A}"


async def test_other_cidr_cannot_reach_test_host(provider, test_host: NetHost) -> None:
    network = NetworkConfig(allow_out=["10.99.0.0/16"])
    async with await AsyncSandbox.create(provider=provider, network=network) as box:
        assert (await _probe(box, test_host.address, PORT_A)).startswith("ERR")


async def test_deny_beats_allow(provider, test_host: NetHost) -> None:
    whole = NetworkConfig(
        allow_out=[f"{test_host.address}/30"], deny_out=[f"{test_host.address}/32"]
    )
    async with await AsyncSandbox.create(provider=provider, network=whole) as box:
        assert (await _probe(box, test_host.address, PORT_A)).startswith("ERR")
    one_port = NetworkConfig(
        allow_out=[f"{test_host.address}/32"], deny_out=[f"{test_host.address}:{PORT_A}"]
    )
    async with await AsyncSandbox.create(provider=provider, network=one_port) as box:
        assert (await _probe(box, test_host.address, PORT_A)).startswith("ERR")
        assert await _probe(box, test_host.address, PORT_B) == f"OK hello {PORT_B}"


async def test_port_rule_allows_only_that_port(provider, test_host: NetHost) -> None:
    network = NetworkConfig(allow_out=[f"{test_host.address}:{PORT_B}"])
    async with await AsyncSandbox.create(provider=provider, network=network) as box:
        assert await _probe(box, test_host.address, PORT_B) == f"OK hello {PORT_B}"
        assert (await _probe(box, test_host.address, PORT_A)).startswith("ERR")


async def test_default_sandbox_has_only_loopback(provider, test_host: NetHost) -> None:
    async with await AsyncSandbox.create(provider=provider) as box:
        assert await _interfaces(box) == ["lo"]
        assert await _probe(box, test_host.address, PORT_A) == "ERR 101"  # ENETUNREACH
        assert not _leftovers_of(box.id)


async def test_sandbox_cannot_reach_host_services(
    provider, test_host: NetHost, host_services: int
) -> None:
    network = NetworkConfig(allow_out=[f"{test_host.address}/32"])
    async with await AsyncSandbox.create(provider=provider, network=network) as box:
        route = (await box.commands.run("cat /proc/net/route")).stdout.splitlines()[1:]
        gateway_hex = next(line.split()[2] for line in route if line.split()[1] == "00000000")
        gateway = str(ipaddress.IPv4Address(bytes.fromhex(gateway_hex)[::-1]))
        assert ipaddress.IPv4Address(gateway) in ipaddress.IPv4Network(box._net.subnet)  # type: ignore[attr-defined]
        # 127.0.0.1 is the sandbox's own loopback: nothing listens there.
        assert await _probe(box, "127.0.0.1", host_services) == "ERR 111"
        for address in (gateway, test_host.host_address):  # addresses of the host itself
            assert (await _probe(box, address, host_services)).startswith("ERR")
        # the test host is still reachable: the rules cut off the host, not the network
        assert await _probe(box, test_host.address, PORT_A) == f"OK hello {PORT_A}"


async def test_nothing_left_after_kill_and_close(test_host: NetHost) -> None:
    from rollbox.sandbox.local import LocalProvider

    provider = LocalProvider(pool_size=1)
    network = NetworkConfig(allow_out=[f"{test_host.address}/32"])
    try:
        box = await AsyncSandbox.create(provider=provider, network=network)
        assert set(_leftovers_of(box.id)) == {"netns", "veth", "nft", "leases"}
        assert await _probe(box, test_host.address, PORT_A) == f"OK hello {PORT_A}"
        await box.kill()
        assert not _leftovers_of(box.id)
        # a sandbox taken from the pool was booted with the same network
        box = await AsyncSandbox.create(provider=provider, network=network)
        assert await _probe(box, test_host.address, PORT_A) == f"OK hello {PORT_A}"
    finally:
        await provider.close()
    assert not _netns.leftovers()  # no netns, veth, sandbox table, nor the forwarding guard
    # forwarding is back as it was (off, unless someone else had turned it on)
    assert not (_netns._dir() / "forwarding-enabled").exists()


_OWNER = textwrap.dedent(
    """
    import asyncio, sys
    from rollbox import AsyncSandbox
    from rollbox.sandbox.local import LocalProvider
    from rollbox.sandbox.models import NetworkConfig

    async def main():
        provider = LocalProvider()
        box = await AsyncSandbox.create(
            provider=provider, network=NetworkConfig(allow_out=[sys.argv[1]])
        )
        print(box.id, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


@pytest.mark.timeout(60)
def test_reaper_removes_network_of_killed_owner(test_host: NetHost) -> None:
    from rollbox.sandbox.local import LocalProvider

    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, f"{test_host.address}/32"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        sandbox_id = owner.stdout.readline().strip()
        assert sandbox_id.startswith("sb-"), sandbox_id
        assert set(_leftovers_of(sandbox_id)) == {"netns", "veth", "nft", "leases"}
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    # A SIGKILLed owner cleans nothing up: the reaper does (this one, or that of any other
    # LocalProvider starting on the machine meanwhile). The network part alone goes by the
    # lease's dead owner, whatever state directory the reaping process uses.
    _netns.reap()
    assert not _leftovers_of(sandbox_id)
    LocalProvider().cleanup()  # cgroups and the record
    assert not (_host.state_dir() / "sandboxes" / f"{sandbox_id}.json").exists()


def test_reaper_removes_network_without_record() -> None:
    from rollbox.sandbox.local import LocalProvider

    sandbox_id = "sb-" + secrets.token_hex(6)
    net = _netns.setup(sandbox_id, NetworkConfig(allow_out=["10.99.0.0/16"]))
    try:
        # (not checked here that it all exists: any LocalProvider starting on the machine, such
        # as another test session's, reaps it at once, as it should)
        LocalProvider().cleanup()
        assert not _leftovers_of(sandbox_id)
    finally:
        _netns.teardown(net)
        _netns.release_host_if_idle()


def test_teardown_is_idempotent() -> None:
    sandbox_id = "sb-" + secrets.token_hex(6)
    net = _netns.setup(sandbox_id, NetworkConfig(allow_out=["10.99.0.0/16"]))
    assert _netns.teardown(net)
    assert _netns.teardown(net)
    assert _netns.teardown(net.record())
    assert not _leftovers_of(sandbox_id)
    _netns.release_host_if_idle()


def test_unsupported_configs_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BackendUnavailableError, match="IPv4"):
        _netns.require(NetworkConfig(allow_out=["fd00::/8"]))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(BackendUnavailableError, match="root"):
        _netns.require(NetworkConfig(allow_out=["10.0.0.0/8"]))


def test_setup_and_teardown_time() -> None:
    """Not a benchmark: a guard that a sandbox network stays well under a second."""
    started = time.perf_counter()
    net = _netns.setup("sb-" + secrets.token_hex(6), NetworkConfig(allow_out=["10.99.0.0/16"]))
    assert _netns.teardown(net)
    _netns.release_host_if_idle()
    assert time.perf_counter() - started < 2.0
