"""Ray provider throughput: one node against two (or all) nodes, and the local backend as baseline.

    python bench/ray_scaling.py [--lifecycles N] [--instances M] [--concurrency C]
    python bench/ray_scaling.py --address HOST:PORT   # an existing cluster: one node vs all

Without ``--address`` it starts a Ray cluster on this machine, on loopback only: a head with no
CPU (it hosts no sandbox) and two nodes of one CPU each. Measured, each in the same run:

(a) sandboxes per second: create + ``commands.run("true")`` + kill, C at a time;
(b) ``run_rollouts`` of M short instances (setup writes a file, the agent runs a Python
    one-liner, a fresh scoring sandbox checks the answer on the host), C at a time;
(c) the median round trip of ``commands.run("true")`` in a live sandbox, and this process's
    CPU time per sandbox of (a): what driving the sandboxes costs the caller;

with ``LocalProvider`` in this process (the baseline: no Ray), ``RayProvider(node=<one node>)``
and ``RayProvider()`` over every node. Ratios: each against the local baseline, and all nodes
against one node. On one machine every node shares the same cores, so the node ratio shows
what one host actor per node costs or gains (one more Python process driving sandboxes), not
how a cluster scales: see the README's Ray section.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from typing import Any

# Without --address the cluster is this machine's own: Ray then takes 127.0.0.1 for its nodes'
# address instead of the machine's outward one (set before Ray is imported).
if "--address" not in sys.argv:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray

from rollbox import AsyncSandbox
from rollbox.runner import AgentResult, run_rollouts
from rollbox.sandbox.base import Provider
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.ray import RayProvider


class Sums:
    """Each instance asks for a sum; the answer is checked on the host."""

    def __init__(self, count: int) -> None:
        self._instances = [{"id": f"s{i}", "a": i, "b": 2 * i} for i in range(count)]

    def instances(self) -> list[dict[str, Any]]:
        return self._instances

    def template(self, instance: dict[str, Any]) -> str:
        return "python"

    async def setup(self, sandbox: AsyncSandbox, instance: dict[str, Any]) -> bool:
        await sandbox.files.write("/work/task.txt", f"{instance['a']} {instance['b']}\n")
        return True

    async def score(self, sandbox: AsyncSandbox, instance: dict[str, Any], patch: str) -> dict:
        answer = (await sandbox.files.read_text("/work/answer.txt")).strip()
        return {"score": float(answer == str(instance["a"] + instance["b"]))}


class OneLiner:
    async def solve(
        self, sandbox: AsyncSandbox, instance: dict[str, Any], *, model: str | None
    ) -> AgentResult:
        result = await sandbox.commands.run(
            "python3 -c \"a, b = map(int, open('task.txt').read().split()); print(a + b)\""
        )
        return AgentResult(patch=result.stdout, files={"/work/answer.txt": result.stdout})


async def lifecycles_per_second(
    provider: Provider, count: int, concurrency: int
) -> tuple[float, float]:
    """Cycles per second, and this process's CPU seconds per cycle (the driver's cost)."""
    todo = iter(range(count))

    async def worker() -> None:
        for _ in todo:
            async with await AsyncSandbox.create(provider=provider) as sandbox:
                result = await sandbox.commands.run("true")
                assert result.exit_code == 0, result

    await lifecycles_warm_up(provider, concurrency)
    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return count / (time.perf_counter() - started), (time.process_time() - cpu) / count


async def round_trip_ms(provider: Provider, repeat: int = 50) -> float:
    """Median milliseconds of ``commands.run("true")`` in a live sandbox, one at a time."""
    async with await AsyncSandbox.create(provider=provider) as sandbox:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            await sandbox.commands.run("true")
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


async def lifecycles_warm_up(provider: Provider, concurrency: int) -> None:
    """Start the provider's hosts and the host processes' caches before the clock runs."""
    boxes = await asyncio.gather(
        *(AsyncSandbox.create(provider=provider) for _ in range(concurrency))
    )
    await asyncio.gather(*(b.commands.run("true") for b in boxes))
    await asyncio.gather(*(b.kill() for b in boxes))


async def rollouts_per_second(provider: Provider, count: int, concurrency: int) -> float:
    started = time.perf_counter()
    rollouts = await run_rollouts(
        Sums(count), OneLiner(), provider=provider, n_concurrent=concurrency
    )
    elapsed = time.perf_counter() - started
    bad = [r for r in rollouts if r.score != 1.0]
    assert not bad, f"rollouts failed: {bad[:3]}"
    return count / elapsed


async def measure(name: str, provider: Provider, args: argparse.Namespace) -> dict[str, float]:
    try:
        lifecycle, cpu = await lifecycles_per_second(provider, args.lifecycles, args.concurrency)
        rollout = await rollouts_per_second(provider, args.instances, args.concurrency)
        trip = await round_trip_ms(provider)
    finally:
        await provider.close()
    print(
        f"  {name:<26} {lifecycle:7.1f} sandboxes/s {rollout:7.1f} instances/s "
        f"{trip:6.2f} ms run('true') {cpu * 1000:6.2f} ms driver CPU/sandbox",
        flush=True,
    )
    return {"lifecycle": lifecycle, "rollout": rollout, "trip": trip}


def start_local_cluster() -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    cluster.wait_for_nodes()
    return cluster


async def main(args: argparse.Namespace) -> None:
    cluster = None
    if args.address:
        ray.init(address=args.address, logging_level="WARNING")
    else:
        cluster = start_local_cluster()
    try:
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
        print(
            f"rollbox Ray scaling: {len(nodes)} nodes with CPUs, Ray {ray.__version__}, "
            f"{os.cpu_count()} cores here, {platform.python_version()}; {args.lifecycles} "
            f"lifecycles and {args.instances} instances, {args.concurrency} at a time",
            flush=True,
        )
        per_cpu = max(8.0, args.concurrency)  # slots never limit the figures
        local = await measure("local (no Ray, baseline)", LocalProvider(), args)
        one = await measure(
            "ray, one node", RayProvider(node=nodes[0]["NodeID"], sandboxes_per_cpu=per_cpu), args
        )
        every = await measure(
            f"ray, {len(nodes)} nodes", RayProvider(sandboxes_per_cpu=per_cpu), args
        )
    finally:
        if cluster is not None:
            ray.shutdown()
            cluster.shutdown()
    print(f"run('true') round trip: ray one node {one['trip'] - local['trip']:+.2f} ms over local")
    for key, what in (("lifecycle", "sandboxes/s"), ("rollout", "instances/s")):
        print(
            f"{what:<12} ray one node / local {one[key] / local[key]:5.2f}x   "
            f"ray {len(nodes)} nodes / one node {every[key] / one[key]:5.2f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lifecycles", type=int, default=200, help="create+run+kill cycles")
    parser.add_argument("--instances", type=int, default=64, help="run_rollouts instances")
    parser.add_argument("--concurrency", type=int, default=8, help="at a time")
    parser.add_argument("--address", help="an existing Ray cluster (default: start one here)")
    asyncio.run(main(parser.parse_args()))
