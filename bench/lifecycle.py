"""Sandbox life-cycle benchmark of the local backend, against bare subprocesses measured in the same run.

    python bench/lifecycle.py [--n N] [--pool-size K] [--json PATH]

What it measures (medians and p90 of many repetitions, warm-up iterations excluded):

(a) one "episode": create a sandbox, write ``/work/x.py``, run ``python3 /work/x.py``, kill.
    Baseline: write the same file to a host temp dir and ``subprocess.run([python3, path])`` with
    the interpreter the sandbox's ``python3`` is (the template's). Measured with the default
    provider (a pool of 2 sandboxes booted ahead; ``--pool-size K`` for another size): warmed up
    first, then back to back (the pool refills in the background while the loop runs) and paced
    (an untimed pause between episodes, as an agent's thinking time would give; its baseline
    pauses as long, as a machine waking from idle is slower); the pool hit rate says whether it
    kept up. And with ``pool_size=0``, where every create boots a sandbox.
    Then once more from a host process holding ``--host-gib`` of memory, as a trainer does.
(b) the round trip of ``commands.run("true")`` in a live sandbox, async API and sync facade, back
    to back and after an idle pause (the realistic case: a model thinks between commands).
    Baseline: ``subprocess.run(["true"])``, back to back and after the same pause.
(c) full create + ``run("true")`` + kill cycles per second with 2 and 4 asyncio tasks on one
    default provider (its pool on). Baseline: bare ``subprocess.run(["true"])`` per second from
    as many threads.

Ratios are "times the baseline's cost" (for rates: baseline rate / rollbox rate). Needs what the
local backend needs (bwrap, cgroup v1 memory/pids/cpu; root on most machines). Other sandboxes
or CPU load on the machine skew the figures: the header and footer say how loaded it was, and
whether the kernel expedites RCU grace periods (/sys/kernel/rcu_expedited), which changes them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rollbox import AsyncSandbox
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.sync import Sandbox, run_sync

PROGRAM = 'def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\nprint("ok")\n'
HOST_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


# -- statistics and the table ------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values)


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def p10(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.1 * len(ordered)) - 1)]


@dataclass
class Row:
    """One line of the table. Latencies in ms; rates in sandboxes (or processes) per second."""

    section: str
    name: str
    unit: str  # "ms" or "/s"
    rollbox_median: float
    rollbox_p90: float  # latency: 90th percentile; rate: 10th percentile (the slow end either way)
    baseline_median: float | None
    target: str
    passed: bool | None
    samples: int
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if not self.baseline_median:
            return None
        if self.unit == "/s":
            return self.baseline_median / self.rollbox_median
        return self.rollbox_median / self.baseline_median


def latency_row(
    section: str,
    name: str,
    rollbox: list[float],
    baseline: list[float] | None,
    *,
    max_ratio: float | None = None,
    max_ms: float | None = None,
    note: str = "",
    **extra: Any,
) -> Row:
    row = Row(
        section,
        name,
        "ms",
        median(rollbox),
        p90(rollbox),
        median(baseline) if baseline else None,
        "",
        None,
        len(rollbox),
        note,
        extra,
    )
    if max_ratio is not None and row.ratio is not None:
        row.target, row.passed = f"<= {max_ratio:g}x", row.ratio <= max_ratio
    elif max_ms is not None:
        row.target, row.passed = f"< {max_ms:g} ms", row.rollbox_median < max_ms
    return row


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'measurement':<50} {'rollbox med':>11} {'p90':>9} {'baseline':>9} {'ratio':>7}  "
        f"{'target':<10} result"
    )
    print()
    print(header)
    print("-" * len(header))
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            print(f"[{section}]")
        unit = row.unit
        baseline = f"{row.baseline_median:.2f}" if row.baseline_median is not None else "-"
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        result = "-" if row.passed is None else ("PASS" if row.passed else "FAIL")
        print(
            f"  {row.name:<48} {row.rollbox_median:>8.2f}{unit:>3} {row.rollbox_p90:>9.2f} "
            f"{baseline:>9} {ratio:>7}  {row.target:<10} {result}"
        )
        if row.note:
            print(f"  {'':<48} ({row.note})")
    print()
    print("p90 is the slow end: the 90th percentile of latencies, the 10th percentile of rates.")


# -- baselines: bare subprocesses on the host ------------------------------------------------


def host_episode(python: str, directory: Path, index: int) -> float:
    path = directory / f"x{index}.py"
    start = time.perf_counter()
    path.write_text(PROGRAM)
    result = subprocess.run([python, str(path)], capture_output=True, env=HOST_ENV, cwd=directory)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0 and result.stdout == b"ok\n", result
    return elapsed * 1000


def host_episodes(python: str, n: int, warmup: int, pause_s: float = 0.0) -> list[float]:
    times = []
    with tempfile.TemporaryDirectory(prefix="rollbox-bench-") as tmp:
        for index in range(warmup + n):
            time.sleep(pause_s)
            times.append(host_episode(python, Path(tmp), index))
    return times[warmup:]


def host_true(n: int, warmup: int, pause_s: float = 0.0) -> list[float]:
    times = []
    for _ in range(warmup + n):
        time.sleep(pause_s)
        start = time.perf_counter()
        subprocess.run(["true"], env=HOST_ENV)
        times.append((time.perf_counter() - start) * 1000)
    return times[warmup:]


def host_rate(parallel: int, cycles: int, rounds: int) -> list[float]:
    """Bare subprocesses per second, from `parallel` threads (one warm-up round excluded)."""
    rates = []
    with ThreadPoolExecutor(parallel) as pool:
        for round_index in range(rounds + 1):
            start = time.perf_counter()
            list(pool.map(lambda _: subprocess.run(["true"], env=HOST_ENV), range(cycles)))
            if round_index:
                rates.append(cycles / (time.perf_counter() - start))
    return rates


# -- rollbox ---------------------------------------------------------------------------------


async def episode(provider: LocalProvider) -> tuple[float, str]:
    """One episode; returns its time in ms and the sandbox's id."""
    start = time.perf_counter()
    sandbox = await AsyncSandbox.create(provider=provider)
    try:
        await sandbox.files.write("/work/x.py", PROGRAM)
        result = await sandbox.commands.run("python3 /work/x.py")
    finally:
        await sandbox.kill()
    elapsed = time.perf_counter() - start
    assert result.exit_code == 0 and result.stdout == "ok\n", result
    return elapsed * 1000, sandbox.id


def pool_of(provider: LocalProvider) -> Any:
    """The provider's warm pool for the default spec (a private detail, read for reporting)."""
    pools = getattr(provider, "_pools", {})
    return next(iter(pools.values()), None)


async def wait_for_pool(provider: LocalProvider, size: int, timeout: float = 20.0) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        pool = pool_of(provider)
        if pool is not None and sum(1 for s in pool if s.alive) >= size:
            break
        await asyncio.sleep(0.005)
    return time.perf_counter() - start


async def pooled_episodes(
    provider: LocalProvider, n: int, warmup: int, pause_s: float
) -> tuple[list[float], int]:
    """Episodes on a warm pool; returns the times and how many took a sandbox from the pool."""
    times, hits = [], 0
    for index in range(warmup + n):
        pool = pool_of(provider)
        pooled = {s.id for s in pool if s.alive} if pool is not None else set()
        elapsed, sandbox_id = await episode(provider)
        if index >= warmup:
            times.append(elapsed)
            hits += sandbox_id in pooled
        if pause_s:
            await asyncio.sleep(pause_s)
    return times, hits


async def round_trips(
    sandbox: AsyncSandbox, n: int, warmup: int, pause_s: float = 0.0
) -> list[float]:
    times = []
    for index in range(warmup + n):
        if pause_s:
            await asyncio.sleep(pause_s)
        start = time.perf_counter()
        result = await sandbox.commands.run("true")
        elapsed = time.perf_counter() - start
        assert result.exit_code == 0, result
        if index >= warmup:
            times.append(elapsed * 1000)
    return times


async def rate(provider: LocalProvider, parallel: int, cycles: int, rounds: int) -> list[float]:
    """Full create + run("true") + kill cycles per second (one warm-up round excluded)."""

    async def cycle() -> None:
        async with await AsyncSandbox.create(provider=provider) as sandbox:
            result = await sandbox.commands.run("true")
            assert result.exit_code == 0, result

    rates = []
    for round_index in range(rounds + 1):
        remaining = cycles

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await cycle()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(parallel)))
        if round_index:
            rates.append(cycles / (time.perf_counter() - start))
    return rates


def sync_round_trips(provider: LocalProvider, n: int, warmup: int) -> list[float]:
    """`Sandbox` (the blocking facade) on the shared loop thread."""
    sandbox = Sandbox.create(provider=provider)
    try:
        times = []
        for index in range(warmup + n):
            start = time.perf_counter()
            result = sandbox.commands.run("true")
            elapsed = time.perf_counter() - start
            assert result.exit_code == 0, result
            if index >= warmup:
                times.append(elapsed * 1000)
        return times
    finally:
        sandbox.kill()


# -- leak check ------------------------------------------------------------------------------


def leftovers(ids: set[str], provider: LocalProvider) -> list[str]:
    """Cgroups, state records and child bwrap processes of this run that are still there."""
    found = []
    for parent in provider.cgroups.parents.values():
        found += [str(p) for p in parent.glob("sb-*") if p.name in ids]
    found += [str(p) for p in provider.state_dir.glob("*.json") if p.stem in ids]
    me = str(os.getpid())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("Name", "").strip() == "bwrap" and fields.get("PPid", "").strip() == me:
            found.append(f"bwrap pid {proc.name}")
    return found


def others_running() -> str:
    """Other sandboxes on the machine share the CPUs and skew the figures: say so."""
    count = 0
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            count += proc.name.isdigit() and (proc / "comm").read_text().strip() == "bwrap"
    return f"{count} bwrap processes of others running" if count else "no other sandboxes running"


def rcu_expedited() -> str:
    """Moving a process between cgroups waits for an RCU grace period (~10 ms here) unless another
    move happened in the last ~20 ms, or the kernel expedites grace periods: say which."""
    try:
        value = Path("/sys/kernel/rcu_expedited").read_text().strip()
    except OSError:
        value = "?"
    return f"/sys/kernel/rcu_expedited={value}"


class IdTracker:
    """Collects the id of every sandbox the providers of this run ever created."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        original = LocalProvider._new_id

        def new_id(provider: LocalProvider) -> str:
            sandbox_id = original(provider)
            self.ids.add(sandbox_id)
            return sandbox_id

        LocalProvider._new_id = new_id  # type: ignore[method-assign]


# -- main ------------------------------------------------------------------------------------


def step(label: str) -> Callable[[], None]:
    start = time.perf_counter()
    print(f"  {label} ...", end="", flush=True)

    def done() -> None:
        print(f" {time.perf_counter() - start:.1f}s", flush=True)

    return done


async def run_async_parts(
    args: argparse.Namespace, rows: list[Row], baselines: dict[str, Any]
) -> None:
    n, warmup, size = args.n, args.warmup, args.pool_size

    # (a) no pool: every create boots a sandbox
    done = step(f"(a) {n} episodes, pool_size=0")
    provider = LocalProvider(pool_size=0)
    try:
        times = [(await episode(provider))[0] for _ in range(warmup + n)][warmup:]
    finally:
        await provider.close()
    done()
    rows.append(
        latency_row(
            "a  create + write x.py + run python3 x.py + kill",
            "no pool (pool_size=0): every create boots",
            times,
            baselines["episode"],
            max_ratio=2.0,
        )
    )

    # (a) warm pool (the default provider's, unless --pool-size): back to back, then paced
    if size != 0:
        provider = LocalProvider(pool_size=size)
        size = provider.pool_size
        which = "default provider" if args.pool_size is None else "provider"
        done = step(
            f"(a) {n} episodes, {which} (pool of {size}), back to back and paced "
            f"{args.pause_ms:g} ms"
        )
        try:
            start = time.perf_counter()
            await episode(provider)  # the first create of a spec starts its pool
            await wait_for_pool(provider, size)
            warm_s = time.perf_counter() - start
            back, back_hits = await pooled_episodes(provider, n, warmup, 0.0)
            await wait_for_pool(provider, size)
            paced, paced_hits = await pooled_episodes(provider, n, warmup, args.pause_ms / 1000)
        finally:
            await provider.close()
        done()
        for label, times, hits, pause, baseline in (
            ("back to back", back, back_hits, 0.0, "episode"),
            (f"paced, {args.pause_ms:g} ms apart", paced, paced_hits, args.pause_ms, "paced"),
        ):
            rows.append(
                latency_row(
                    "a  create + write x.py + run python3 x.py + kill",
                    f"{which} (pool of {size}), {label}",
                    times,
                    baselines[baseline],
                    max_ratio=2.0,
                    note=f"pool hits {hits}/{len(times)}; first create to a full pool of {size}: "
                    f"{warm_s * 1000:.0f} ms" + ("; the baseline pauses as long" if pause else ""),
                    pool_hits=hits,
                    pause_ms=pause,
                    pool_fill_ms=warm_s * 1000,
                )
            )

    # (a) the same from a host process as big as a trainer (torch, a model): a fork of it would
    # copy its page tables; rollbox's spawner helper starts bwrap instead, so it should not matter
    if args.host_gib > 0:
        count = max(10, n // 5)
        done = step(
            f"(a) {count} episodes, pool_size=0, host process holding {args.host_gib:g} GiB"
        )
        ballast = bytearray(int(args.host_gib * 2**30))
        for index in range(0, len(ballast), 4096):
            ballast[index] = 1  # touched: resident
        provider = LocalProvider(pool_size=0)  # every create boots: what a big host costs it
        try:
            big = [(await episode(provider))[0] for _ in range(warmup + count)][warmup:]
        finally:
            await provider.close()
            del ballast
        done()
        rows.append(
            latency_row(
                "a  create + write x.py + run python3 x.py + kill",
                f"no pool, host process of {args.host_gib:g} GiB RSS",
                big,
                baselines["episode"],
                max_ratio=2.0,
                note="the baseline is the small host process's: subprocess.run pays no fork",
                host_gib=args.host_gib,
            )
        )

    # (b) round trip of `true` in a live sandbox
    done = step(
        f"(b) {args.rt_n} round trips of `true`, async; {args.idle_n} after {args.idle_ms:g} ms idle"
    )
    provider = LocalProvider()
    try:
        sandbox = await AsyncSandbox.create(provider=provider)
        try:
            back = await round_trips(sandbox, args.rt_n, warmup)
            idle = await round_trips(sandbox, args.idle_n, 2, args.idle_ms / 1000)
        finally:
            await sandbox.kill()
    finally:
        await provider.close()
    done()
    section = "b  round trip of commands.run('true') in a live sandbox"
    rows.append(latency_row(section, "async, back to back", back, baselines["true"], max_ms=3.0))
    rows.append(
        latency_row(
            section,
            f"async, after {args.idle_ms:g} ms idle",
            idle,
            baselines["true_idle"],
            max_ms=3.0,
            note="the realistic case: a model thinks between commands; the baseline idles as "
            "long, as a waking machine is slower",
        )
    )

    # (c) full cycles per second
    for parallel in args.parallel:
        done = step(f"(c) {args.rounds} rounds of {args.cycles} cycles at {parallel} in parallel")
        provider = LocalProvider()
        try:
            rates = await rate(provider, parallel, args.cycles, args.rounds)
        finally:
            await provider.close()
        done()
        base = baselines["rate"][parallel]
        row = Row(
            "c  create + run('true') + kill, sandboxes per second",
            f"{parallel} in parallel (asyncio tasks, default provider)",
            "/s",
            median(rates),
            p10(rates),
            median(base),
            ">= 80/s",
            median(rates) >= 80,
            len(rates),
            f"{args.rounds} rounds of {args.cycles} cycles",
        )
        rows.append(row)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=100, help="timed episodes per (a) measurement")
    parser.add_argument(
        "--pool-size",
        type=int,
        default=None,
        help="K for the pooled rows of (a) (default: the default provider's pool); 0 skips them",
    )
    parser.add_argument(
        "--pause-ms", type=float, default=100.0, help="untimed pause of the paced pool run"
    )
    parser.add_argument(
        "--idle-ms", type=float, default=100.0, help="idle pause before each idle round trip"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed iterations before each measurement"
    )
    parser.add_argument("--cycles", type=int, default=60, help="cycles per throughput round")
    parser.add_argument("--rounds", type=int, default=5, help="timed throughput rounds")
    parser.add_argument("--parallel", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--host-gib",
        type=float,
        default=2.0,
        help="also run (a) from a host process holding this much memory, like a trainer; 0 skips",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    args.rt_n = args.n * 5
    args.idle_n = max(10, args.n // 4)

    tracker = IdTracker()
    probe = LocalProvider()
    python = probe.template("python").python
    started = time.perf_counter()
    print(
        f"rollbox lifecycle benchmark: {platform.node()}, {os.cpu_count()} CPUs, "
        f"Linux {platform.release()}, Python {platform.python_version()}"
    )
    print(f"sandbox python3 (and the baseline's): {python}; bwrap: {probe.bwrap}")
    print(f"load average {os.getloadavg()[0]:.2f}; {others_running()}; {rcu_expedited()}")

    baselines: dict[str, Any] = {}
    done = step(f"baselines: {args.n} host episodes, {args.rt_n} `true`, rates")
    baselines["episode"] = host_episodes(python, args.n, args.warmup)
    baselines["paced"] = host_episodes(python, args.n // 2, 2, args.pause_ms / 1000)
    baselines["true"] = host_true(args.rt_n, args.warmup)
    baselines["true_idle"] = host_true(args.idle_n, 2, args.idle_ms / 1000)
    baselines["rate"] = {p: host_rate(p, args.cycles * 2, args.rounds) for p in args.parallel}
    done()

    rows: list[Row] = []
    asyncio.run(run_async_parts(args, rows, baselines))

    done = step(f"(b) {args.rt_n} round trips of `true`, sync facade")
    sync_provider = LocalProvider()
    try:
        sync_times = sync_round_trips(sync_provider, args.rt_n, args.warmup)
    finally:
        run_sync(sync_provider.close())
    done()
    rows.insert(
        next(i for i, r in enumerate(rows) if r.section.startswith("b")) + 1,
        latency_row(
            "b  round trip of commands.run('true') in a live sandbox",
            "sync facade (Sandbox), back to back",
            sync_times,
            baselines["true"],
            max_ms=3.0,
        ),
    )

    print_table(rows)
    leaked = leftovers(tracker.ids, probe)
    print(f"load average {os.getloadavg()[0]:.2f}; {others_running()}")
    print(
        f"sandboxes created: {len(tracker.ids)}; left behind: {leaked or 'nothing'}; "
        f"total {time.perf_counter() - started:.1f}s"
    )
    if args.json:
        figures = {
            "date": datetime.now(UTC).isoformat(),
            "rcu_expedited": rcu_expedited(),
            "host": {
                "node": platform.node(),
                "cpus": os.cpu_count(),
                "kernel": platform.release(),
                "python": platform.python_version(),
                "sandbox_python": python,
            },
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
            "leftovers": leaked,
            "sandboxes_created": len(tracker.ids),
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))
        print(f"figures written to {args.json}")
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
