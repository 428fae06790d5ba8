"""The cost of the network: commands through ``rollbox serve`` against the local backend, same run.

    python bench/remote.py [--n N] [--url URL]

Starts ``rollbox serve`` on 127.0.0.1 (unless ``--url`` names a running server), then measures,
with the same commands on the same machine:

(a) the round trip of ``commands.run("true")`` in a live sandbox: ``provider="remote"`` against
    a local sandbox (the baseline);
(b) a whole sandbox: create + ``run("true")`` + kill, remote against local;
(c) a 1 MiB file written and read back, remote against local.

Prints medians and p90 in milliseconds and the ratio remote / local. Loopback only measures
rollbox's own overhead (HTTP, JSON, the server's event loop), not a real network's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

from rollbox import AsyncSandbox
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.remote import RemoteProvider


async def timed(n: int, step: Callable[[], Awaitable[object]], warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        await step()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await step()
        times.append((time.perf_counter() - start) * 1000)
    return times


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def start_server() -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLBOX_TOKEN"}
    server = subprocess.Popen(
        [sys.executable, "-m", "rollbox", "serve", "--port", "0", "--env", "none"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert server.stdout is not None
    line = server.stdout.readline()
    if "listening on " not in line:
        server.kill()
        raise SystemExit(f"rollbox serve did not start: {line!r}")
    return server, line.split("listening on ", 1)[1].split()[0]


async def measure(url: str, n: int) -> list[tuple[str, list[float], list[float]]]:
    local, remote = LocalProvider(), RemoteProvider(url)
    rows = []
    try:
        async with (
            await AsyncSandbox.create(provider=local) as near,
            await AsyncSandbox.create(provider=remote) as far,
        ):
            rows.append(
                (
                    'run("true") round trip',
                    await timed(n, lambda: near.commands.run("true")),
                    await timed(n, lambda: far.commands.run("true")),
                )
            )
            data = os.urandom(1024 * 1024)

            async def write_read(sandbox: AsyncSandbox) -> None:
                await sandbox.files.write("/work/blob", data)
                assert await sandbox.files.read("/work/blob") == data

            rows.append(
                (
                    "1 MiB write + read",
                    await timed(n // 4 or 1, lambda: write_read(near)),
                    await timed(n // 4 or 1, lambda: write_read(far)),
                )
            )

        async def lifecycle(provider: LocalProvider | RemoteProvider) -> None:
            async with await AsyncSandbox.create(provider=provider) as sandbox:
                await sandbox.commands.run("true")

        rows.append(
            (
                "create + run + kill",
                await timed(n // 4 or 1, lambda: lifecycle(local)),
                await timed(n // 4 or 1, lambda: lifecycle(remote)),
            )
        )
    finally:
        await remote.close()
        await local.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="repetitions (default 200)")
    parser.add_argument("--url", help="a running rollbox server (default: start one)")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        server, url = start_server()
    try:
        rows = asyncio.run(measure(url, args.n))
    finally:
        if server is not None:
            server.terminate()
            server.wait(20)
    print(f"rollbox remote vs local, {os.cpu_count()} cores, server {url}")
    print(f"{'':26} {'local ms':>16} {'remote ms':>16} {'ratio':>7}")
    print(f"{'':26} {'median':>8}{'p90':>8} {'median':>8}{'p90':>8}")
    for name, near, far in rows:
        ratio = statistics.median(far) / statistics.median(near)
        print(
            f"{name:26} {statistics.median(near):8.2f}{p90(near):8.2f} "
            f"{statistics.median(far):8.2f}{p90(far):8.2f} {ratio:6.2f}x"
        )


if __name__ == "__main__":
    main()
