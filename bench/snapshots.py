"""Templates and snapshots: create-from-template, fork-from-snapshot and `docker run --rm`, side by side.

    python bench/snapshots.py [--n N] [--large-mb MB] [--docker-n N] [--json PATH]

Each row times one sandbox start until its first command has run: create (or fork), run
``cat /work/marker`` (which proves the files are there), kill. Medians and p90 over ``--n``
repetitions after a warm-up.

Local backend:
  - ``template python``: the built-in template (the host's tools, read-only root);
  - ``template layered``: a rollbox Template built into overlay layers (python base + 2 steps);
  - ``fork small``: from a snapshot of a few files;
  - ``fork large``: from a snapshot of ``--large-mb`` MB in 2,000 files plus one big file.
    Forks stack the snapshot as a read-only overlay layer: the target is < 15 ms whatever its
    size, and a fork should cost about what a create costs;
  - ``fork large, pool 2``: the same with ``LocalProvider(pool_size=2)``, which boots forks
    ahead of demand (the other rows run between its forks, as a model's turns would).
Rows run in shuffled rounds, so that the machine's load hits them alike.
Docker backend (when an Engine answers at DOCKER_HOST or the default socket):
  - ``docker run --rm``: the baseline, ``docker run --rm --network none IMAGE cat /etc/hostname``
    with the docker CLI, on the image rollbox imports for its ``python`` template;
  - ``docker create``: rollbox's Docker provider, the same lifecycle as the local rows;
  - ``docker fork``: from a committed snapshot (its /work is copied back into the tmpfs).

Ratios: every row against ``docker run --rm`` measured in the same run, and each fork against
its backend's create from the template it was taken from.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollbox import AsyncSandbox, Template
from rollbox.sandbox.base import Provider
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.templates import RunStep

MARKER = "echo ready > /work/marker"


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(0.9 * len(ordered) + 0.5) - 1)]


async def lifecycle(provider: Provider, **create: Any) -> float:
    """Seconds from create to the first command's result, then kill (not timed)."""
    start = time.perf_counter()
    sandbox = await AsyncSandbox.create(provider=provider, **create)
    result = await sandbox.commands.run("cat /work/marker")
    elapsed = time.perf_counter() - start
    await sandbox.kill()
    if result.stdout != "ready\n":
        raise RuntimeError(f"the sandbox did not see its files: {result}")
    return elapsed


async def timed(n: int, warmup: int, run: Callable[[], Awaitable[float]]) -> list[float]:
    for _ in range(warmup):
        await run()
    return [await run() for _ in range(n)]


async def interleaved(
    n: int, warmup: int, runs: dict[str, Callable[[], Awaitable[float]]]
) -> dict[str, list[float]]:
    """Rounds over the rows in a shuffled order: the machine's load, and whatever the previous
    row left behind, hit them all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for index in range(warmup + n):
        random.shuffle(order)
        for name in order:
            elapsed = await runs[name]()
            if index >= warmup:
                times[name].append(elapsed)
    return times


async def prepared_snapshot(provider: Provider, large_mb: int, **create: Any) -> Any:
    """A sandbox with the marker (and, for large, many files and one big one), snapshotted."""
    async with await AsyncSandbox.create(provider=provider, **create) as sandbox:
        script = MARKER
        if large_mb:
            script += (
                " && mkdir /work/many && for i in $(seq 2000); do "
                "head -c 4096 /dev/urandom > /work/many/$i; done && "
                f"head -c {max(1, large_mb - 8)}000000 /dev/urandom > /work/big"
            )
        result = await sandbox.commands.run(script, timeout_seconds=600)
        if not result.ok:
            raise RuntimeError(f"preparing the snapshot failed: {result}")
        start = time.perf_counter()
        snapshot = await sandbox.snapshot()
        return snapshot, time.perf_counter() - start


def docker_run_rm(image: str, n: int, warmup: int) -> list[float] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    argv = [docker, "run", "--rm", "--network", "none", image, "cat", "/etc/hostname"]
    times = []
    for index in range(warmup + n):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30, help="repetitions of local rows (30)")
    parser.add_argument("--docker-n", type=int, default=10, help="repetitions of docker rows (10)")
    parser.add_argument("--large-mb", type=int, default=200, help="size of the large snapshot")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    rows: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    local = LocalProvider(pool_size=0)  # every create boots (the pooled row is below)
    pooled = LocalProvider(pool_size=2)  # forks booted ahead of demand, between rollouts
    layered = Template(
        name="bench-layered",
        steps=[RunStep(run="mkdir -p /opt/bench"), RunStep(run="echo built > /opt/bench/marker")],
    )
    try:
        small, small_s = await prepared_snapshot(local, 0)
        large, large_s = await prepared_snapshot(local, args.large_mb)
        os.sync()  # the large snapshot's writeback would slow whatever runs next
        notes["local fork small"] = f"snapshot of {small.size_bytes} B took {small_s * 1e3:.0f} ms"
        notes["local fork large"] = (
            f"snapshot of {large.size_bytes / 1e6:.0f} MB took {large_s * 1e3:.0f} ms"
        )
        # the marker comes from a snapshot for forks; for creates, the first command writes it
        rows.update(
            await interleaved(
                args.n,
                3,
                {
                    "local template python": lambda: lifecycle_with_marker(local),
                    "local template layered": lambda: lifecycle_with_marker(
                        local, from_template=layered
                    ),
                    "local fork small": lambda: lifecycle(local, from_snapshot=small),
                    "local fork large": lambda: lifecycle(local, from_snapshot=large),
                    "local fork large, pool 2": lambda: lifecycle(pooled, from_snapshot=large),
                },
            )
        )
        await AsyncSandbox.delete_snapshot(small, provider=local)
        await AsyncSandbox.delete_snapshot(large, provider=local)
    finally:
        await local.close()
        await pooled.close()

    docker_rows = await docker_section(args)
    rows.update(docker_rows[0])
    notes.update(docker_rows[1])
    report(rows, notes, args.json)


async def lifecycle_with_marker(provider: Provider, **create: Any) -> float:
    """A create's lifecycle; the command that writes the marker is the first command."""
    start = time.perf_counter()
    sandbox = await AsyncSandbox.create(provider=provider, **create)
    result = await sandbox.commands.run(f"{MARKER} && cat /work/marker")
    elapsed = time.perf_counter() - start
    await sandbox.kill()
    if result.stdout != "ready\n":
        raise RuntimeError(f"the sandbox failed: {result}")
    return elapsed


async def docker_section(args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, str]]:
    from rollbox.sandbox.docker import DockerEngineError, DockerProvider

    try:
        docker = DockerProvider()
    except DockerEngineError as exc:
        print(f"(docker rows skipped: {exc})", file=sys.stderr)
        return {}, {}
    rows: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    try:
        rows["docker create"] = await timed(args.docker_n, 2, lambda: lifecycle_with_marker(docker))
        image = (await docker._named_image("python")).id
        run_rm = await asyncio.to_thread(docker_run_rm, image, args.docker_n, 2)
        if run_rm is not None:
            rows["docker run --rm (baseline)"] = run_rm
        snapshot, seconds = await prepared_snapshot(docker, 0)
        notes["docker fork"] = f"commit + capture took {seconds * 1e3:.0f} ms"
        rows["docker fork"] = await timed(
            args.docker_n, 2, lambda: lifecycle(docker, from_snapshot=snapshot)
        )
        await AsyncSandbox.delete_snapshot(snapshot, provider=docker)
    finally:
        await docker.close()
    return rows, notes


def report(rows: dict[str, list[float]], notes: dict[str, str], json_path: str | None) -> None:
    baseline = rows.get("docker run --rm (baseline)")
    base = statistics.median(baseline) if baseline else None
    creates = {
        "local": statistics.median(rows["local template python"]),
        "docker": statistics.median(rows["docker create"]) if "docker create" in rows else None,
    }
    print(f"{'what':32} {'median ms':>10} {'p90 ms':>8} {'vs docker run':>14} {'vs create':>10}")
    table = []
    for name, values in rows.items():
        median = statistics.median(values)
        versus_docker = f"{median / base:.3f}x" if base else "-"
        backend = name.split()[0]
        create = creates.get(backend)
        versus_create = f"{median / create:.2f}x" if create and "fork" in name else ""
        print(
            f"{name:32} {median * 1e3:10.1f} {p90(values) * 1e3:8.1f} {versus_docker:>14} "
            f"{versus_create:>10}  {notes.get(name, '')}"
        )
        table.append(
            {
                "name": name,
                "median_ms": median * 1e3,
                "p90_ms": p90(values) * 1e3,
                "samples": len(values),
                "ratio_vs_docker_run": median / base if base else None,
                "note": notes.get(name, ""),
            }
        )
    forks = {r["name"]: r["median_ms"] for r in table if r["name"].startswith("local fork")}
    if forks:
        plain = max(v for k, v in forks.items() if "pool" not in k)
        pooled = forks.get("local fork large, pool 2")
        print(
            f"\nlocal fork target (< 15 ms at any snapshot size): "
            f"without a pool {plain:.1f} ms ({'met' if plain < 15 else 'not met'}), "
            + (
                f"with pool_size=2 {pooled:.1f} ms ({'met' if pooled < 15 else 'not met'})"
                if pooled
                else ""
            )
        )
    if json_path:
        with open(json_path, "w") as handle:
            json.dump({"rows": table, "cpus": os.cpu_count()}, handle, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
