"""NeMo Gym's sandbox API on rollbox, against NeMo Gym's own ``local`` provider in the same run.

    /path/to/python3.13-venv/bin/python bench/nemo_gym_sandbox.py [--n N]

Needs the venv of the NeMo Gym integration (Python 3.13, ``pip install -e '.[nemo-gym]'``).

What it measures (median and p90 of N repetitions, after warm-up):

(a) one sandbox through ``nemo_gym.sandbox.AsyncSandbox``: start,
    ``exec("/usr/bin/python3 -c pass")``, stop. Baseline: the same with NeMo Gym's ``local``
    provider, which runs the command as a plain host subprocess in a temp directory (no
    isolation at all). The interpreter is named by path: a pyenv shim would slow the baseline.
(b) ``exec("true")`` in a live sandbox, rollbox against NeMo Gym's ``local``.

The ratio is "times the baseline's cost": what isolation costs over running on the host.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable

from nemo_gym.sandbox import AsyncSandbox, SandboxSpec

PROVIDERS = {"nemo-gym local (baseline)": {"local": {}}, "rollbox": {"rollbox": {}}}


async def timed(n: int, warmup: int, step: Callable[[], Awaitable[None]]) -> list[float]:
    for _ in range(warmup):
        await step()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        await step()
        times.append(time.perf_counter() - started)
    return times


def summary(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]


async def main(n: int) -> None:
    # other sandboxes or CPU load skew every figure: say how loaded the machine was
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs, n={n}")
    lifecycle: dict[str, list[float]] = {}
    round_trip: dict[str, list[float]] = {}
    for label, config in PROVIDERS.items():

        async def episode(config: dict = config) -> None:
            sandbox = AsyncSandbox(config, SandboxSpec())
            await sandbox.start()
            try:
                result = await sandbox.exec("/usr/bin/python3 -c pass")
                assert result.return_code == 0, result
            finally:
                await sandbox.stop()

        lifecycle[label] = await timed(n, 3, episode)
        sandbox = AsyncSandbox(config, SandboxSpec())
        await sandbox.start()
        try:

            async def true(sandbox: AsyncSandbox = sandbox) -> None:
                assert (await sandbox.exec("true")).return_code == 0

            round_trip[label] = await timed(n, 3, true)
        finally:
            await sandbox.stop()
    # rollbox's own API on its shared loop, without NeMo Gym: what the adapter adds
    from rollbox import AsyncSandbox as RollboxSandbox
    from rollbox.integrations.nemo_gym import _on_rollbox_loop

    async def direct() -> None:
        sandbox = await RollboxSandbox.create()
        try:
            assert (await sandbox.commands.run("/usr/bin/python3 -c pass")).exit_code == 0
        finally:
            await sandbox.kill()

    lifecycle["rollbox without NeMo Gym"] = await timed(
        n, 3, lambda: _on_rollbox_loop(direct(), shielded=False)
    )
    baseline = "nemo-gym local (baseline)"
    for title, results in (
        ("(a) start + exec('/usr/bin/python3 -c pass') + stop", lifecycle),
        ("(b) exec('true') in a live sandbox", round_trip),
    ):
        print(title)
        base_median, _ = summary(results[baseline])
        for label, times in results.items():
            median, p90 = summary(times)
            print(
                f"  {label:28s} median {median * 1000:7.2f} ms  p90 {p90 * 1000:7.2f} ms"
                f"  ({median / base_median:.2f}x the baseline)"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50)
    asyncio.run(main(parser.parse_args().n))
