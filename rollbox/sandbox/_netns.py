"""Outbound network for local sandboxes: a network namespace, a veth pair and an nftables allow-list.

Each sandbox with ``NetworkConfig(allow_out=...)`` gets, as root:

- a named network namespace ``rbx-<id>`` (``/run/netns/rbx-<id>``) that bwrap's child joins with
  ``setns`` before it drops to the sandbox user (see :func:`enter`);
- a veth pair: ``rbx<hex>`` on the host, ``eth0`` in the sandbox, on a /30 leased from a private
  pool (``ROLLBOX_NET_POOL``, default the first of :data:`DEFAULT_POOLS` that no host route
  overlaps), with the default route via the host side;
- one nftables table ``inet rollbox_<id>`` holding everything else: the forward and input filter
  (deny rules, then allow rules, then reject; replies of allowed connections come back) and the
  masquerade rule, so teardown is one ``nft delete table``.

Routing needs IPv4 forwarding. If it was off, it is switched on together with a guard table
``ip rollbox_guard`` that drops every forwarded packet that neither comes from nor goes to a
``rbx*`` interface, so the host routes nothing it did not route before; both are undone when the
last sandbox network is gone (:func:`release_host_if_idle`).

The kernel objects are machine-wide, so their bookkeeping is too: it lives in
``ROLLBOX_NET_STATE_DIR`` (default ``/run/rollbox/net``) whatever ``ROLLBOX_STATE_DIR`` says,
and providers with different state directories never take each other's networks. A lease
(``leases/<subnet>``: sandbox id, owner pid and start time, record path) is taken under a file
lock after the sandbox's record is written and before any of its network exists, and removed
last, so :func:`reap` can tell a leftover: a network object without a lease, or whose lease's
owner died or whose record is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import json
import os
import random
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rollbox.errors import BackendUnavailableError, SandboxStartError
from rollbox.sandbox import _host
from rollbox.sandbox.models import NetworkConfig, parse_network_rule

POOL_ENV = "ROLLBOX_NET_POOL"
DEFAULT_POOLS = ("10.213.0.0/16", "172.30.213.0/24", "192.168.213.0/24")
NETNS_DIR = Path("/run/netns")
GUARD_TABLE = "rollbox_guard"
_NETNS_RE = re.compile(r"^rbx-(sb-[0-9a-f]{12})$")
_VETH_RE = re.compile(r"^rbx([0-9a-f]{12})$")
_TABLE_RE = re.compile(r"^table inet rollbox_(sb_[0-9a-f]{12})$")
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
_REJECT = "reject with icmpx type admin-prohibited"
_ROUTE_TYPES = {
    "local", "broadcast", "unicast", "unreachable", "prohibit", "blackhole", "multicast",
    "anycast", "throw", "nat",
}  # fmt: skip
_FIX = "install them with `apt-get install iproute2 nftables`"


@dataclass(frozen=True)
class SandboxNet:
    """The network objects of one sandbox, all named after its id."""

    sandbox_id: str
    subnet: str | None = None  # "10.213.0.4/30"; None if the lease was never taken

    @property
    def netns(self) -> str:
        return f"rbx-{self.sandbox_id}"

    @property
    def veth(self) -> str:
        return "rbx" + self.sandbox_id.removeprefix("sb-")  # at most 15 characters

    @property
    def table(self) -> str:
        return "rollbox_" + self.sandbox_id.replace("-", "_")

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    def record(self) -> dict[str, str | None]:
        return {"id": self.sandbox_id, "subnet": self.subnet}


# -- checks ------------------------------------------------------------------------------------


@functools.cache
def _tools() -> tuple[str, str] | None:
    ip, nft = shutil.which("ip", path=_SEARCH_PATH), shutil.which("nft", path=_SEARCH_PATH)
    return (ip, nft) if ip and nft else None


def require(network: NetworkConfig) -> None:
    """Raise BackendUnavailableError unless sandboxes with this network config can be made here."""
    if os.geteuid() != 0:
        raise BackendUnavailableError(
            "NetworkConfig(allow_out=...) on the local backend needs root: it creates a network "
            "namespace, a veth pair and nftables rules per sandbox. Run as root, or use no network"
        )
    if _tools() is None:
        raise BackendUnavailableError(
            f"NetworkConfig(allow_out=...) on the local backend needs `ip` and `nft`: {_FIX}"
        )
    for rule in network.allow_out:
        if parse_network_rule(rule)[0].version != 4:
            raise BackendUnavailableError(
                f"allow_out rule {rule!r}: the local backend gives sandboxes IPv4 only; "
                "give IPv4 CIDRs"
            )
    pool()


def _route_networks() -> list[ipaddress.IPv4Network]:
    """Destinations of the host's IPv4 routes (all tables), except those of rollbox's veths."""
    ip = _tools()
    assert ip is not None
    out = subprocess.run(
        [ip[0], "-4", "-o", "route", "show", "table", "all"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    found = []
    for line in out.splitlines():
        words = line.split()
        if not words:
            continue
        device = words[words.index("dev") + 1] if "dev" in words[:-1] else ""
        if _VETH_RE.match(device):
            continue
        dest = words[1] if words[0] in _ROUTE_TYPES and len(words) > 1 else words[0]
        if dest == "default":
            continue
        with contextlib.suppress(ValueError):
            found.append(ipaddress.IPv4Network(dest, strict=False))
    return found


@functools.cache
def pool() -> ipaddress.IPv4Network:
    """The private range sandbox /30s are leased from; it must not overlap a host route."""
    configured = os.environ.get(POOL_ENV)
    candidates = [configured] if configured else list(DEFAULT_POOLS)
    routes = _route_networks()
    for text in candidates:
        try:
            network = ipaddress.IPv4Network(text)
        except ValueError as exc:
            raise BackendUnavailableError(
                f"{POOL_ENV}={text!r} is not an IPv4 network such as 10.213.0.0/16"
            ) from exc
        if network.prefixlen > 30 or not network.is_private:
            raise BackendUnavailableError(
                f"{POOL_ENV}={text!r} must be a private IPv4 range of /30 or larger"
            )
        if not any(network.overlaps(route) for route in routes):
            return network
    raise BackendUnavailableError(
        f"the sandbox address range{'s' if len(candidates) > 1 else ''} {', '.join(candidates)} "
        f"overlap{'' if len(candidates) > 1 else 's'} this host's routes (`ip route`): set "
        f"{POOL_ENV} to a free private range, e.g. 10.254.0.0/16"
    )


# -- host state: lock, leases, forwarding ------------------------------------------------------


def _dir() -> Path:
    return Path(os.environ.get("ROLLBOX_NET_STATE_DIR", "/run/rollbox/net"))


@contextlib.contextmanager
def _locked() -> Iterator[Path]:
    directory = _dir()
    (directory / "leases").mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield directory
    finally:
        os.close(fd)


def _run(argv: list[str], script: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, input=script, capture_output=True, text=True, check=False, close_fds=True
    )


def _ip_forward(value: str | None = None) -> str:
    path = Path("/proc/sys/net/ipv4/ip_forward")
    if value is not None:
        path.write_text(value)
        return value
    return path.read_text().strip()


def _ensure_forwarding(directory: Path) -> None:
    """Turn IPv4 forwarding on, guarded so that only rollbox veths are routed. Under the lock."""
    marker = directory / "forwarding-enabled"
    if _ip_forward() == "1":
        return
    nft = _tools()[1]  # type: ignore[index]
    guard = (
        f"table ip {GUARD_TABLE} {{\n chain forward {{\n"
        "  type filter hook forward priority filter; policy accept;\n"
        '  iifname != "rbx*" oifname != "rbx*" drop\n }\n}\n'
    )
    done = _run([nft, "-f", "-"], guard)
    if done.returncode != 0:
        raise SandboxStartError(
            f"cannot install the nftables forwarding guard: {done.stderr.strip()}"
        )
    marker.write_text("rollbox turned net.ipv4.ip_forward on; it turns it off when idle\n")
    _ip_forward("1")


def release_host_if_idle() -> bool:
    """Undo the forwarding rollbox turned on, once no sandbox network is leased. True if undone."""
    directory = _dir()
    if os.geteuid() != 0 or not (directory / "forwarding-enabled").exists() or _tools() is None:
        return False
    with _locked():
        if any((directory / "leases").iterdir()):
            return False
        _ip_forward("0")
        _run([_tools()[1], "delete", "table", "ip", GUARD_TABLE])  # type: ignore[index]
        (directory / "forwarding-enabled").unlink(missing_ok=True)
        return True


def _lease(directory: Path, sandbox_id: str, record: str | None) -> ipaddress.IPv4Network:
    network = pool()
    slots = network.num_addresses // 4
    start = random.randrange(slots)
    base = int(network.network_address)
    leases = directory / "leases"
    for step in range(slots):
        subnet = ipaddress.IPv4Network((base + 4 * ((start + step) % slots), 30))
        try:
            fd = os.open(
                leases / str(subnet.network_address), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
            )
        except FileExistsError:
            continue
        owner = {
            "id": sandbox_id,
            "subnet": str(subnet),
            "owner_pid": os.getpid(),
            "owner_start": _host.process_start_time(os.getpid()),
            "record": record,
        }
        os.write(fd, json.dumps(owner).encode())
        os.close(fd)
        return subnet
    raise SandboxStartError(
        f"all {slots} sandbox subnets of {network} are leased: set {POOL_ENV} to a larger range",
        sandbox_id=sandbox_id,
    )


def _unlease(directory: Path, net: SandboxNet) -> None:
    if net.subnet is None:
        return
    path = directory / "leases" / str(ipaddress.IPv4Network(net.subnet).network_address)
    lease = _read_lease(path)
    if lease is None or lease.get("id") == net.sandbox_id:
        path.unlink(missing_ok=True)


def _read_lease(path: Path) -> dict[str, object] | None:
    """A lease's content; None if it is gone or unreadable (a torn write: a dead process's)."""
    try:
        lease = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return lease if isinstance(lease, dict) else None


def _lease_alive(lease: dict[str, object]) -> bool:
    """Whether a lease's sandbox may still be live: its owner runs and its record exists."""
    pid, record = lease.get("owner_pid"), lease.get("record")
    if not isinstance(pid, int) or not isinstance(record, str):
        return False
    return _host.process_start_time(pid) == lease.get("owner_start") and os.path.exists(record)


# -- one sandbox -------------------------------------------------------------------------------


def _ruleset(net: SandboxNet, network: NetworkConfig, sandbox_ip: str) -> str:
    def rule(text: str, verdict: str) -> str | None:
        cidr, port = parse_network_rule(text)
        if cidr.version != 4:
            return None  # the sandbox has no IPv6 at all
        match = f"ip daddr {cidr}"
        if port is not None:
            match += f" meta l4proto {{ tcp, udp }} th dport {port}"
        return f"  {match} {verdict}"

    deny = [r for r in (rule(t, _REJECT) for t in network.deny_out) if r]
    allow = [r for r in (rule(t, "accept") for t in network.allow_out) if r]
    veth = net.veth
    return "\n".join(
        [
            f"table inet {net.table} {{",
            " chain egress {",
            "  meta nfproto != ipv4 drop",
            f"  ip saddr != {sandbox_ip} drop",
            *deny,
            *allow,
            f"  {_REJECT}",
            " }",
            " chain forward {",
            "  type filter hook forward priority filter; policy accept;",
            f'  iifname "{veth}" jump egress',
            f'  oifname "{veth}" ct state established,related accept',
            f'  oifname "{veth}" drop',
            " }",
            " chain input {",  # the host itself is a destination like any other
            "  type filter hook input priority filter; policy accept;",
            f'  iifname "{veth}" jump egress',
            " }",
            " chain postrouting {",
            "  type nat hook postrouting priority srcnat; policy accept;",
            f'  ip saddr {sandbox_ip} oifname != "{veth}" masquerade',
            " }",
            "}",
            "",
        ]
    )


def setup(sandbox_id: str, network: NetworkConfig, record: str | None = None) -> SandboxNet:
    """Create the sandbox's namespace, veth and rules; SandboxStartError if that fails.

    Args:
        record: the path of the sandbox's record, written before this call. While it exists
            and this process lives, :func:`reap` leaves the network alone; without it, the
            network counts as a leftover at once.
    """
    require(network)
    if not re.fullmatch(r"sb-[0-9a-f]{12}", sandbox_id):  # names must fit IFNAMSIZ and reap()
        raise SandboxStartError(f"sandbox id {sandbox_id!r} is not sb-<12 hex digits>")
    ip, nft = _tools()  # type: ignore[misc]
    with _locked() as directory:
        _ensure_forwarding(directory)
        subnet = _lease(directory, sandbox_id, record)
    net = SandboxNet(sandbox_id, str(subnet))
    gateway, sandbox_ip = str(subnet.network_address + 1), str(subnet.network_address + 2)
    host_side = (
        f"netns add {net.netns}\n"
        f"link add {net.veth} type veth peer name eth0 netns {net.netns}\n"
        f"link set {net.veth} addrgenmode none\n"
        f"addr add {gateway}/30 dev {net.veth}\n"
        f"link set {net.veth} up\n"
    )
    sandbox_side = (
        "link set lo up\n"
        "link set eth0 addrgenmode none\n"
        f"addr add {sandbox_ip}/30 dev eth0\n"
        "link set eth0 up\n"
        f"route add default via {gateway} dev eth0\n"
    )
    steps = [
        ([ip, "-batch", "-"], host_side),
        ([ip, "-n", net.netns, "-batch", "-"], sandbox_side),
        ([nft, "-f", "-"], _ruleset(net, network, sandbox_ip)),
    ]
    for argv, script in steps:
        done = _run(argv, script)
        if done.returncode != 0:
            teardown(net)
            raise SandboxStartError(
                f"cannot set up the network of {sandbox_id} ({' '.join(argv[:1] + argv[-2:])}): "
                f"{done.stderr.strip() or done.stdout.strip()}",
                sandbox_id=sandbox_id,
            )
    return net


def open_netns(net: SandboxNet) -> int:
    """An fd of the sandbox's namespace, for the spawner's child to join (close-on-exec)."""
    return os.open(net.netns_path, os.O_RDONLY | os.O_CLOEXEC)


def teardown(net: SandboxNet | dict[str, str | None] | None) -> bool:
    """Remove a sandbox's veth, namespace, table and lease. Idempotent; True once all are gone.

    The veth goes first, so the sandbox is cut off before its rules are. Each step waits on the
    kernel (RCU grace periods): ~20 ms each here, and no faster when run in parallel.
    """
    if net is None:
        return True
    if isinstance(net, dict):
        net = SandboxNet(str(net["id"]), net.get("subnet"))
    tools = _tools()
    if tools is None or os.geteuid() != 0:
        return False
    ip, nft = tools
    veth = Path("/sys/class/net", net.veth)
    if veth.exists() or net.netns_path.exists():
        _run([ip, "-force", "-batch", "-"], f"link del {net.veth}\nnetns del {net.netns}\n")
    deleted = _run([nft, "delete", "table", "inet", net.table])
    table_gone = deleted.returncode == 0 or "No such file" in deleted.stderr
    done = table_gone and not veth.exists() and not net.netns_path.exists()
    if done and net.subnet is not None:
        with _locked() as directory:
            _unlease(directory, net)
    return done


def reap() -> int:
    """Remove sandbox networks whose owner died or whose record is gone; returns how many.

    Network objects are listed before leases are read: a lease is taken before any of its
    sandbox's network exists and removed after all of it, so a live sandbox's network is
    never mistaken for a leftover.
    """
    directory = _dir()
    tools = _tools()
    if os.geteuid() != 0 or tools is None or not directory.is_dir():
        return 0
    found: set[str] = set()
    with contextlib.suppress(OSError):
        found.update(m.group(1) for n in os.listdir(NETNS_DIR) if (m := _NETNS_RE.match(n)))
    found.update(
        f"sb-{m.group(1)}" for n in os.listdir("/sys/class/net") if (m := _VETH_RE.match(n))
    )
    for line in _run([tools[1], "list", "tables"]).stdout.splitlines():
        if m := _TABLE_RE.match(line.strip()):
            found.add(m.group(1).replace("_", "-", 1))
    leases: dict[str, tuple[str | None, bool]] = {}  # sandbox id -> (subnet, alive)
    with contextlib.suppress(OSError):
        for path in (directory / "leases").iterdir():
            lease = _read_lease(path)
            if lease is None:  # torn: its writer died between create and write
                with _locked():
                    if _read_lease(path) is None:
                        path.unlink(missing_ok=True)
                continue
            leases[str(lease["id"])] = (str(lease.get("subnet")), _lease_alive(lease))
    reaped = 0
    for sandbox_id in found | set(leases):
        subnet, alive = leases.get(sandbox_id, (None, False))
        if not alive:
            teardown(SandboxNet(sandbox_id, subnet))
            reaped += 1
    return reaped


def leftovers() -> dict[str, list[str]]:
    """rollbox's network objects on this machine (namespaces, veths, tables); for tests and doctor."""
    found: dict[str, list[str]] = {"netns": [], "veth": [], "nft": []}
    with contextlib.suppress(OSError):
        found["netns"] = sorted(n for n in os.listdir(NETNS_DIR) if _NETNS_RE.match(n))
    found["veth"] = sorted(n for n in os.listdir("/sys/class/net") if _VETH_RE.match(n))
    tools = _tools()
    if tools is not None and os.geteuid() == 0:
        out = _run([tools[1], "list", "tables"]).stdout
        found["nft"] = sorted(
            line.split()[-1]
            for line in out.splitlines()
            if line.split()[-1:] and line.split()[-1].startswith("rollbox_")
        )
    return {k: v for k, v in found.items() if v}
