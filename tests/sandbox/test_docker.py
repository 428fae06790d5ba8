"""The Docker backend on a real Engine: limits, isolation, labels and the reaper.

The conformance suite (test_conformance.py) checks the shared contract; these check what is
Docker's own: how limits are mapped, what a container may do, and what is left after a crash.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from rollbox import AsyncSandbox, ConfigError, Limits, SandboxStartError
from rollbox.errors import BackendUnavailableError, SandboxFileError
from rollbox.sandbox.docker import DockerEngineError, DockerProvider
from rollbox.sandbox.templates import _copy_host_file
from tests.sandbox._docker import containers_of, docker_provider, make_docker_provider

pytestmark = pytest.mark.docker
__all__ = ["docker_provider"]  # the fixture, imported for pytest

SMALL = Limits(memory_mb=128, pids=64, cpus=0.5, disk_mb=16, output_bytes=100_000)


def inspect(provider: DockerProvider, sandbox: AsyncSandbox) -> dict[str, object]:
    container = sandbox.container_id  # type: ignore[attr-defined]
    return provider.client.sync_call("GET", f"/containers/{container}/json").json()


async def test_unreachable_engine_is_a_typed_error_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DockerEngineError, match="start dockerd, or set DOCKER_HOST"):
        DockerProvider(host=f"unix://{tmp_path}/no.sock")
    with pytest.raises(BackendUnavailableError, match="unix:// and tcp://"):
        DockerProvider(host="ssh://somewhere")


async def test_limits_are_mapped_onto_the_container(docker_provider: DockerProvider) -> None:
    async with await AsyncSandbox.create(
        provider=docker_provider, limits=SMALL, ttl_seconds=60, name="mapped"
    ) as sb:
        config = inspect(docker_provider, sb)
        host = config["HostConfig"]
        assert host["Memory"] == host["MemorySwap"] == 128 * 1024 * 1024
        assert host["PidsLimit"] == 64 and host["NanoCpus"] == 500_000_000
        assert host["NetworkMode"] == "none" and host["CapDrop"] == ["ALL"]
        assert "no-new-privileges" in host["SecurityOpt"]
        assert "size=16777216" in host["Tmpfs"]["/work"]
        labels = config["Config"]["Labels"]
        assert (
            labels["rollbox.sandbox"] == sb.id and labels["rollbox.owner"] == docker_provider.owner
        )
        assert labels["rollbox.name"] == "mapped" and float(labels["rollbox.expires"]) > time.time()


async def test_memory_pids_and_disk_limits_hold(docker_provider: DockerProvider) -> None:
    async with await AsyncSandbox.create(provider=docker_provider, limits=SMALL) as sb:
        hog = await sb.commands.run(
            "python3 -c 'x = bytearray(400 * 1024 * 1024); print(len(x))'", timeout_seconds=60
        )
        assert hog.exit_code != 0 and "419430400" not in hog.stdout, hog
        bomb = await sb.commands.run(
            "for i in $(seq 200); do sleep 30 & done; echo done", timeout_seconds=60
        )
        assert "fork" in bomb.stderr.lower(), bomb  # the shell was refused processes
        stats = docker_provider.client.sync_call(
            "GET", f"/containers/{sb.container_id}/stats", params={"stream": "false"}
        ).json()
        assert 0 < stats["pids_stats"]["current"] <= 64, stats["pids_stats"]
        await sb.commands.kill_all()  # the agent needs no fork for it
        filler = await sb.commands.run(
            "for i in 1 2 3 4 5 6; do head -c 4000000 /dev/zero > /work/f$i || exit 9; done",
            timeout_seconds=60,
        )
        assert filler.exit_code == 9 and "No space left" in filler.stderr, filler
        with pytest.raises(SandboxFileError, match="disk_mb"):
            await sb.files.write("/work/big", b"x" * (17 * 1024 * 1024))
        # the sandbox survived all of it
        assert (await sb.commands.run("echo alive")).stdout == "alive\n"


async def test_container_has_no_network_no_privileges_and_hides_its_agent(
    docker_provider: DockerProvider,
) -> None:
    async with await AsyncSandbox.create(provider=docker_provider) as sb:
        probe = await sb.commands.run(
            "python3 - <<'EOF'\n"
            "import socket, os\n"
            "print(sorted(n for _, n in socket.if_nameindex()))\n"
            "s = socket.socket(); s.settimeout(2)\n"
            "try:\n"
            "    s.connect(('1.1.1.1', 80)); print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
            "status = open('/proc/self/status').read()\n"
            "print(*[l for l in status.splitlines() if l.startswith(('CapEff', 'NoNewPrivs'))])\n"
            "print(os.getuid(), os.getgid())\n"
            "EOF"
        )
        lines = probe.stdout.splitlines()
        assert lines[0] == "['lo']" and lines[1].startswith("refused"), probe
        assert "CapEff:\t0000000000000000" in lines[2] and "NoNewPrivs:\t1" in lines[2]
        assert lines[3] == "65534 65534"
        # the agent (PID 1) is not dumpable: its memory and environment are not readable,
        # and it cannot be traced or signalled away
        agent = await sb.commands.run(
            'cat /proc/1/environ; kill -9 1; python3 -c "import ctypes;'
            'print(ctypes.CDLL(None).ptrace(16, 1, 0, 0))"'
        )
        assert "ROLLBOX_AGENT" not in agent.stdout and "Permission denied" in agent.stderr
        assert agent.stdout.strip().endswith("-1"), agent
        assert (await sb.commands.run("echo still")).stdout == "still\n"


async def test_file_api_links_resolve_inside_the_container(docker_provider: DockerProvider) -> None:
    async with await AsyncSandbox.create(provider=docker_provider) as sb:
        await sb.commands.run("ln -s /etc/hostname /work/host-link && ln -s / /work/root")
        assert await sb.files.read_text("/work/host-link") == "sandbox\n"
        await sb.files.write("/work/root/tmp/through-link", "x")  # lands in the container's /tmp
        assert (await sb.commands.run("cat /tmp/through-link")).stdout == "x"
    assert not Path("/tmp/through-link").exists()


async def test_read_only_root_option() -> None:
    provider = make_docker_provider(read_only_root=True)
    try:
        async with await AsyncSandbox.create(provider=provider) as sb:
            assert inspect(provider, sb)["HostConfig"]["ReadonlyRootfs"] is True
            denied = await sb.commands.run("touch /var/tmp/x")
            assert "Read-only file system" in denied.stderr, denied
            assert (await sb.commands.run("echo ok > /work/x && cat /work/x")).stdout == "ok\n"
    finally:
        await provider.close()


async def test_images_by_name_and_unknown_images(docker_provider: DockerProvider) -> None:
    async with await AsyncSandbox.create(provider=docker_provider) as sb:
        image = inspect(docker_provider, sb)["Image"]
    tags = docker_provider.client.sync_call("GET", f"/images/{image}/json").json()["RepoTags"]
    async with await AsyncSandbox.create(from_template=tags[0], provider=docker_provider) as sb:
        assert sb.template_id == image
        assert (await sb.commands.run("python3 -c 'print(1+1)'")).stdout == "2\n"
    with pytest.raises(ConfigError, match="could not be pulled"):
        await AsyncSandbox.create(
            from_template="rollbox-test/no-such-image:1", provider=docker_provider
        )


async def test_image_without_python_is_a_start_error_naming_python3(
    docker_provider: DockerProvider, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    for name in ("bin", "lib", "lib64"):
        host = Path("/") / name
        if host.is_symlink():
            (root / os.readlink(host)).mkdir(parents=True, exist_ok=True)
            (root / name).symlink_to(os.readlink(host))
    for binary in ("/bin/sh", "/bin/cat"):
        _copy_host_file(os.path.realpath(binary), root)
        libraries = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
        for path in (p for p in libraries.split() if p.startswith("/")):
            _copy_host_file(path, root)
    archive = tmp_path / "root.tar"
    with tarfile.open(archive, "w") as tar:
        for entry in root.iterdir():
            tar.add(entry, arcname=entry.name)
    tag = f"rollbox-test/no-python:{os.getpid()}"
    docker_provider.client.sync_call(
        "POST",
        "/images/create",
        params={"fromSrc": "-", "repo": tag.split(":")[0], "tag": tag.split(":")[1]},
        content=archive.read_bytes(),
    )
    try:
        with pytest.raises(SandboxStartError, match="python3"):
            await AsyncSandbox.create(from_template=tag, provider=docker_provider)
    finally:
        docker_provider.client.sync_call("DELETE", f"/images/{tag}", params={"force": "1"})


async def test_network_allow_lists_are_refused(docker_provider: DockerProvider) -> None:
    from rollbox import NetworkConfig

    with pytest.raises(BackendUnavailableError, match="local provider"):
        await AsyncSandbox.create(
            provider=docker_provider, network=NetworkConfig(allow_out=["10.0.0.0/8"])
        )


OWNER_SCRIPT = """
import asyncio, sys
from rollbox import AsyncSandbox
from rollbox.sandbox.docker import DockerProvider

async def main():
    provider = DockerProvider()
    sandbox = await AsyncSandbox.create(provider=provider)
    print(sandbox.container_id, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _container_exists(provider: DockerProvider, container_id: str) -> bool:
    try:
        provider.client.sync_call("GET", f"/containers/{container_id}/json")
    except DockerEngineError as exc:
        if exc.status == 404:
            return False
        raise
    return True


async def test_kill_9_of_the_owner_leaves_no_container(docker_provider: DockerProvider) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        container = owner.stdout.readline().strip()
        assert _container_exists(docker_provider, container)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        # the attach connection closes, the agent reads EOF and exits, AutoRemove removes
        deadline = time.monotonic() + 30
        while _container_exists(docker_provider, container) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not _container_exists(docker_provider, container)
    finally:
        owner.kill()
        owner.wait()


async def test_reaper_removes_containers_of_dead_owners_and_expired_ones(
    docker_provider: DockerProvider,
) -> None:
    async with await AsyncSandbox.create(provider=docker_provider) as sb:
        image = inspect(docker_provider, sb)["Image"]
    made = []
    dead_owner = f"{docker_provider.owner.split(':')[0]}:999999:1"
    for labels in (
        {"rollbox.sandbox": "sb-deadowner", "rollbox.owner": dead_owner},
        {
            "rollbox.sandbox": "sb-expired",
            "rollbox.owner": docker_provider.owner,
            "rollbox.expires": str(time.time() - 60),
        },
        {"rollbox.sandbox": "sb-alive", "rollbox.owner": docker_provider.owner},
    ):
        created = docker_provider.client.sync_call(
            "POST",
            "/containers/create",
            json={"Image": image, "Entrypoint": [], "Cmd": ["sleep", "600"], "Labels": labels},
        ).json()["Id"]
        made.append(created)
    try:
        reaped = docker_provider.cleanup()
        assert reaped >= 2
        assert not _container_exists(docker_provider, made[0])
        assert not _container_exists(docker_provider, made[1])
        assert _container_exists(docker_provider, made[2]), "a live owner's container was reaped"
    finally:
        for container in made:
            docker_provider._remove_container_now(container)
    assert json.dumps(containers_of(docker_provider)).count("sb-alive") == 0
