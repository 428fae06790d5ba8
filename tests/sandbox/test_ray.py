"""The ray provider on a real multi-node Ray cluster on this machine (``_ray.py``).

Placement is checked from the outside: a sandbox's bwrap process (named in the local backend's
state record) is started by the spawner helper of a Ray worker, itself a child of the raylet of
the node it is on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="the ray provider needs Ray: pip install 'rollbox[ray]'")

from rollbox import AsyncSandbox
from rollbox.errors import ConfigError, SandboxDeadError, SandboxStartError, TooManySandboxesError
from rollbox.runner import AgentResult, run_rollouts
from rollbox.sandbox import _host
from rollbox.sandbox.ray import RayProvider, RaySandbox
from rollbox.sandbox.registry import get_provider, provider_names
from tests.conftest import assert_no_leftovers, reap_until_clean
from tests.sandbox._ray import RayCluster, ray_cluster, stop_ray_cluster

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    yield ray_cluster()
    stop_ray_cluster()


def _record(sandbox_id: str) -> dict[str, Any]:
    return json.loads((_host.state_dir() / "sandboxes" / f"{sandbox_id}.json").read_text())


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def _node_of(cluster: RayCluster, sandbox: AsyncSandbox) -> str:
    """The node a sandbox runs on, seen from the process tree: bwrap < the worker's spawner
    helper < worker < raylet."""
    bwrap = _record(sandbox.id)["pid"]
    raylet = _parent(_parent(_parent(bwrap)))
    names = [name for name in cluster.nodes if cluster.raylet_pid(name) == raylet]
    assert len(names) == 1, f"{sandbox.id}: bwrap {bwrap} is under no node's raylet"
    assert cluster.node_id(names[0]) == sandbox.node_id  # type: ignore[attr-defined]
    return names[0]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def _wait_gone(pids: list[int], seconds: float = 60.0) -> list[int]:
    """The pids still alive after waiting up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        await asyncio.sleep(0.1)
    return [p for p in pids if not _gone(p)]


async def test_sandboxes_spread_over_nodes_by_free_capacity(cluster: RayCluster) -> None:
    provider = RayProvider(sandboxes_per_cpu=3)  # nodes a and b: one CPU, three slots each
    try:
        boxes = await asyncio.gather(*(AsyncSandbox.create(provider=provider) for _ in range(4)))
        assert Counter(_node_of(cluster, b) for b in boxes) == {"a": 2, "b": 2}
        # Free two slots on b: the next two sandboxes go where the free capacity is.
        on_b = [b for b in boxes if _node_of(cluster, b) == "b"]
        for box in on_b:
            await box.kill()
        more = [await AsyncSandbox.create(provider=provider) for _ in range(2)]
        assert [_node_of(cluster, b) for b in more] == ["b", "b"]
        # Every slot taken (3 per node): no fifth... seventh sandbox, unless told to wait.
        more.append(await AsyncSandbox.create(provider=provider))
        more.append(await AsyncSandbox.create(provider=provider))
        with pytest.raises(TooManySandboxesError, match="every slot"):
            await AsyncSandbox.create(provider=provider, wait_for_slot=False)
        live = {info.id for info in await provider.list()}
        assert live == {b.id for b in boxes + more if b.alive}
        assert all(info.provider == "ray" for info in await provider.list())
        ids = {b.id for b in boxes + more}
        hosts = [node["host_pid"] for node in provider.nodes().values()]
        assert len(hosts) == 2
    finally:
        await provider.close()
    assert_no_leftovers(ids)
    assert await _wait_gone(hosts, 30) == [], "close() left host actors running"


async def test_a_named_node_gets_every_sandbox(cluster: RayCluster) -> None:
    provider = RayProvider(node=cluster.node_id("b"))
    try:
        boxes = [await AsyncSandbox.create(provider=provider) for _ in range(3)]
        assert [_node_of(cluster, b) for b in boxes] == ["b", "b", "b"]
        assert list(provider.nodes()) == [cluster.node_id("b")]
        result = await boxes[0].commands.run("echo $((6 * 7))")
        assert result.stdout == "42\n"
    finally:
        await provider.close()
    with pytest.raises(ConfigError, match="names no live node"):
        await AsyncSandbox.create(provider=RayProvider(node="0" * 56))


async def test_sandboxed_code_cannot_reach_the_cluster(cluster: RayCluster) -> None:
    """Ray runs whatever its GCS is asked to: a sandbox must not get to it (nor to a raylet)."""
    ports = [int(cluster.cluster.address.rsplit(":", 1)[1])]
    ports += [node.node_manager_port for node in cluster.nodes.values()]  # type: ignore[attr-defined]
    probe = (
        "import socket, sys\n"
        "for port in map(int, sys.argv[1:]):\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=2); print('open', port)\n"
        "    except OSError as exc:\n"
        "        print('closed', port, exc.errno)\n"
    )
    ports_text = " ".join(map(str, ports))
    # The probe works: from the host, every port answers.
    seen = subprocess.run(
        [sys.executable, "-c", probe, *ports_text.split()], capture_output=True, text=True
    ).stdout
    assert seen.count("open") == len(ports), seen
    provider = RayProvider()
    try:
        async with await AsyncSandbox.create(provider=provider) as sandbox:
            await sandbox.files.write("/work/probe.py", probe)
            result = await sandbox.commands.run(f"python3 probe.py {ports_text}")
    finally:
        await provider.close()
    assert result.stdout.count("closed") == len(ports), result


async def test_run_rollouts_with_provider_ray(cluster: RayCluster) -> None:
    """``provider="ray"`` is the registry's default RayProvider, on the connected cluster."""
    from tests.runner.fixtures import AnswerDataset, ScriptedAgent

    assert "ray" in provider_names()
    dataset = AnswerDataset([{"id": f"q{i}", "expected": str(i * 3)} for i in range(6)])
    rollouts = await run_rollouts(dataset, ScriptedAgent(), provider="ray", n_concurrent=4)
    assert [(r.instance_id, r.score, r.error, r.retries) for r in rollouts] == [
        (f"q{i}", 1.0, None, []) for i in range(6)
    ]
    default = get_provider("ray")
    assert isinstance(default, RayProvider) and len(default.nodes()) == 2
    await default.close()
    assert_no_leftovers(set(dataset.setups))


async def test_snapshots_stay_on_their_node(cluster: RayCluster) -> None:
    provider = RayProvider()
    try:
        async with await AsyncSandbox.create(provider=provider) as source:
            await source.files.write("/work/state.txt", "kept")
            snapshot = await source.snapshot()
        assert snapshot.provider == "ray"
        forks = [await AsyncSandbox.create(from_snapshot=snapshot, provider=provider) for _ in "ab"]
        assert {f.node_id for f in forks} == {source.node_id}  # type: ignore[attr-defined]
        for fork in forks:
            assert await fork.files.read_text("/work/state.txt") == "kept"
        await AsyncSandbox.delete_snapshot(snapshot, provider=provider)
    finally:
        await provider.close()


async def test_bad_settings_are_config_errors(cluster: RayCluster) -> None:
    with pytest.raises(ConfigError, match="max_sandboxes"):
        RayProvider(max_sandboxes=0)
    with pytest.raises(ConfigError, match="sandboxes_per_cpu"):
        RayProvider(sandboxes_per_cpu=0)


class _NodeAwareAgent:
    """Runs a 3 s command; tells the test when one runs on the node it is going to kill."""

    def __init__(self, victim: str) -> None:
        self.victim = victim
        self.on_victim = asyncio.Event()
        self.sandboxes: list[str] = []

    async def solve(
        self, sandbox: AsyncSandbox, instance: dict[str, Any], *, model: str | None
    ) -> AgentResult:
        assert isinstance(sandbox, RaySandbox)
        self.sandboxes.append(sandbox.id)
        if sandbox.node_id == self.victim:
            self.on_victim.set()
        result = await sandbox.commands.run(f"sleep 3; echo {instance['expected']} > answer.txt")
        assert result.exit_code == 0, result
        answer = instance["expected"] + "\n"
        return AgentResult(patch=answer, files={"/work/answer.txt": answer})


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_node_killed_mid_run(cluster: RayCluster) -> None:
    """Sandboxes on a dead node raise the typed error; run_rollouts reruns them elsewhere."""
    from tests.runner.fixtures import AnswerDataset

    victim = cluster.add_node("c")
    provider = RayProvider()
    pinned = RayProvider(node=victim)
    try:
        # A sandbox of its own on c, with a command running when the node dies.
        doomed = await AsyncSandbox.create(provider=pinned)
        running = await doomed.commands.spawn("sleep 1000")
        dataset = AnswerDataset([{"id": f"q{i}", "expected": str(i)} for i in range(9)])
        agent = _NodeAwareAgent(victim)
        run = asyncio.ensure_future(run_rollouts(dataset, agent, provider=provider, n_concurrent=9))
        await asyncio.wait_for(agent.on_victim.wait(), 60)
        assert set(provider.nodes()) == {cluster.node_id(n) for n in "abc"}
        hosts = [p.nodes()[victim]["host_pid"] for p in (provider, pinned)]
        records = [
            _record(i)
            for i in (*agent.sandboxes, doomed.id)
            if (_host.state_dir() / "sandboxes" / f"{i}.json").exists()
        ]
        on_victim = [r for r in records if r["owner_pid"] in hosts]
        assert doomed.id in {r["id"] for r in on_victim} and len(on_victim) >= 2

        await asyncio.to_thread(cluster.kill_node, "c")

        rollouts = await asyncio.wait_for(run, 120)
        assert [(r.instance_id, r.score, r.error) for r in rollouts] == [
            (f"q{i}", 1.0, None) for i in range(9)
        ]
        rerun = [r for r in rollouts if r.retries]
        assert rerun, "no instance was running on the killed node"
        assert all(victim in r.retries[0] and "was lost" in r.retries[0] for r in rerun)
        assert victim not in provider.nodes()

        # The caller's sandbox on c: its command and every later call raise the typed error.
        with pytest.raises(SandboxDeadError) as waited:
            await asyncio.wait_for(running.wait(), 60)
        assert waited.value.reason == "node_died"
        with pytest.raises(SandboxDeadError) as ran:
            await doomed.commands.run("true")
        assert ran.value.reason == "node_died" and not doomed.alive
        with pytest.raises(SandboxStartError, match="cannot host"):
            await AsyncSandbox.create(provider=pinned)

        # The host's worker and its sandboxes died with the node (bwrap --die-with-parent)...
        assert await _wait_gone([*hosts, *(r["pid"] for r in on_victim)]) == []
    finally:
        await provider.close()
        await pinned.close()
    # ...and the reaper (any LocalProvider start on the machine) removes their cgroups and records.
    reap_until_clean({r["id"] for r in records} | set(dataset.setups))


@pytest.mark.slow
async def test_a_killed_host_worker(cluster: RayCluster) -> None:
    """kill -9 of one host's worker process: its sandboxes die, the node takes no new ones."""
    provider = RayProvider()
    try:
        boxes = await asyncio.gather(*(AsyncSandbox.create(provider=provider) for _ in range(2)))
        victim = next(b for b in boxes if _node_of(cluster, b) == "a")
        survivor = next(b for b in boxes if b is not victim)
        bwrap = _record(victim.id)["pid"]
        host = provider.nodes()[cluster.node_id("a")]["host_pid"]
        os.kill(host, signal.SIGKILL)
        assert await _wait_gone([host, bwrap], 30) == []  # bwrap --die-with-parent
        with pytest.raises(SandboxDeadError) as dead:
            await victim.commands.run("true")
        assert dead.value.reason == "node_died" and cluster.node_id("a") in str(dead.value)
        assert (await survivor.commands.run("echo fine")).stdout == "fine\n"
        more = [await AsyncSandbox.create(provider=provider) for _ in range(2)]
        assert [_node_of(cluster, b) for b in more] == ["b", "b"]
        ids = {b.id for b in boxes + more}
    finally:
        await provider.close()
    reap_until_clean(ids)  # the reaper: the dead host's cgroups and records


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_killed_driver_takes_its_hosts_and_sandboxes(
    cluster: RayCluster, tmp_path: Path
) -> None:
    """kill -9 of the process that made the provider: Ray ends its hosts, their sandboxes die."""
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, json, os, sys
            import ray
            from rollbox import AsyncSandbox
            from rollbox.sandbox.ray import RayProvider

            async def main():
                provider = RayProvider({cluster.cluster.address!r})
                boxes = [await AsyncSandbox.create(provider=provider) for _ in range(4)]
                for box in boxes:
                    await box.commands.spawn("sleep 1000")
                hosts = [n["host_pid"] for n in provider.nodes().values()]
                made = {{"ids": [b.id for b in boxes], "hosts": hosts}}
                print("MADE", json.dumps(made), flush=True)  # Ray prints its logs here too
                await asyncio.sleep(1000)

            asyncio.run(main())
            """
        )
    )
    driver = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        line = ""
        while not line.startswith("MADE "):
            line = await asyncio.wait_for(asyncio.to_thread(driver.stdout.readline), 90)  # type: ignore[union-attr]
            assert line, "the driver ended before it made its sandboxes"
        made = json.loads(line.removeprefix("MADE "))
        bwraps = [_record(i)["pid"] for i in made["ids"]]
        assert len(set(made["hosts"])) == 2 and not any(_gone(p) for p in bwraps)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert await _wait_gone(made["hosts"] + bwraps) == []
    reap_until_clean(set(made["ids"]))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rollbox_run_on_a_ray_cluster(cluster: RayCluster, tmp_path: Path) -> None:
    """``rollbox run --provider ray --address ...``: a real command, on the cluster."""
    log = tmp_path / "calls.log"
    env = {**os.environ, "ROLLBOX_TEST_LOG": str(log), "ROLLBOX_TEST_N": "6"}
    done = subprocess.run(
        [
            sys.executable, "-m", "rollbox", "run", "--provider", "ray",
            "--address", cluster.cluster.address,
            "--dataset", "tests.runner.fixtures:dataset", "--agent", "tests.runner.fixtures:agent",
            "--out", str(tmp_path / "out"), "--quiet",
        ],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rollouts = [
        json.loads(line) for line in (tmp_path / "out/results.jsonl").read_text().splitlines()
    ]
    assert sorted((r["instance_id"], r["score"]) for r in rollouts) == [
        (f"q{i}", 1.0) for i in range(6)
    ]
    ids = {line.split()[1] for line in log.read_text().splitlines()}
    assert len(ids) == 6
    assert_no_leftovers(ids)
    misused = subprocess.run(
        [sys.executable, "-m", "rollbox", "run", "--address", "127.0.0.1:1", "--dataset",
         "tests.runner.fixtures:dataset", "--agent", "tests.runner.fixtures:agent",
         "--out", str(tmp_path / "out2")],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert misused.returncode != 0 and "use it with --provider ray" in misused.stderr


class _FailingAgent:
    """Its first ``failures`` calls end as a lost node's would, wrapped as agent code may wrap it."""

    def __init__(self, failures: int, reason: str = "node_died") -> None:
        self.failures = failures
        self.reason = reason
        self.calls = 0

    async def solve(
        self, sandbox: AsyncSandbox, instance: dict[str, Any], *, model: str | None
    ) -> AgentResult:
        self.calls += 1
        if self.calls <= self.failures:
            try:
                raise SandboxDeadError(
                    f"sandbox {sandbox.id} is dead: its node went away",
                    sandbox_id=sandbox.id,
                    reason=self.reason,
                )
            except SandboxDeadError as exc:
                raise RuntimeError("the tool call failed") from exc
        answer = instance["expected"] + "\n"
        return AgentResult(patch=answer, files={"/work/answer.txt": answer})


async def test_run_rollouts_reruns_node_deaths_only_up_to_its_limit(provider: object) -> None:
    from rollbox.runner import NODE_RETRIES
    from tests.runner.fixtures import AnswerDataset

    def dataset() -> AnswerDataset:
        return AnswerDataset([{"id": "q1", "expected": "7"}])

    (twice,) = await run_rollouts(dataset(), _FailingAgent(2), provider=provider)  # type: ignore[arg-type]
    assert (twice.score, twice.error, len(twice.retries)) == (1.0, None, 2)
    assert all("its node went away" in why for why in twice.retries)
    (always,) = await run_rollouts(dataset(), _FailingAgent(99), provider=provider)  # type: ignore[arg-type]
    assert len(always.retries) == NODE_RETRIES and always.score is None
    assert always.error is not None and "RuntimeError" in always.error
    # A sandbox that died of the policy's own doing (OOM) is not infrastructure: no rerun.
    (oom,) = await run_rollouts(dataset(), _FailingAgent(1, "oom"), provider=provider)  # type: ignore[arg-type]
    assert oom.retries == [] and oom.error is not None


def test_the_sync_facade(cluster: RayCluster) -> None:
    from rollbox import Sandbox
    from rollbox.sandbox.sync import run_sync

    provider = RayProvider()
    try:
        with Sandbox.create(provider=provider) as sandbox:
            sandbox.files.write("/work/n.txt", "21")
            result = sandbox.commands.run("echo $(( $(cat n.txt) * 2 ))")
            assert result.stdout == "42\n"
            assert _node_of(cluster, sandbox.async_sandbox) in ("a", "b")
        assert not sandbox.async_sandbox.alive
    finally:
        run_sync(provider.close())
