"""The local backend's warm pool: sandboxes booted ahead of demand (2 per configuration by default).

The rest of the suite runs with ``ROLLBOX_POOL_SIZE=0`` (see ``tests/conftest.py``), because its
tests count processes, cgroups and records; here the pool is on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rollbox import AsyncSandbox, Limits
from rollbox.errors import SandboxDeadError
from rollbox.sandbox.local import LocalProvider, LocalSandbox
from tests.conftest import assert_no_leftovers
from tests.security._attack_helpers import FORK_UNTIL_REFUSED, cgroup_file


@pytest.fixture
async def pooled(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalProvider]:
    monkeypatch.delenv("ROLLBOX_POOL_SIZE")
    provider = LocalProvider()
    yield provider
    await provider.close()


def _warm(provider: LocalProvider) -> list[LocalSandbox]:
    return [s for pool in provider._pools.values() for s in pool if s.alive]


async def _until(condition, seconds: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the pool did not get there")


async def test_the_default_pool_boots_two_ahead_and_create_takes_one(
    pooled: LocalProvider,
) -> None:
    assert pooled.pool_size == 2
    first = await AsyncSandbox.create(provider=pooled)  # booted on demand; two more follow
    await _until(lambda: len(_warm(pooled)) == 2)
    warm = {s.id for s in _warm(pooled)}
    for sandbox_id in warm:  # a warm sandbox is no one's yet: get() does not hand it out
        with pytest.raises(SandboxDeadError):
            await pooled.get(sandbox_id)
    second = await AsyncSandbox.create(provider=pooled)
    assert second.id in warm
    assert (await second.commands.run("echo hi")).stdout == "hi\n"
    # Only one warm sandbox was left: the replacement boots at once.
    await _until(lambda: len(_warm(pooled)) == 2)
    await second.kill()
    await first.kill()


async def test_with_warm_ones_left_the_replacement_boots_after_the_kill() -> None:
    provider = LocalProvider(pool_size=3)
    try:
        async with await AsyncSandbox.create(provider=provider):
            pass
        await _until(lambda: len(_warm(provider)) == 3)
        box = await AsyncSandbox.create(provider=provider)
        await asyncio.sleep(0.3)  # two are left: nothing boots while this one works
        assert len(_warm(provider)) == 2
        await box.kill()
        await _until(lambda: len(_warm(provider)) == 3)
    finally:
        await provider.close()


async def test_a_warm_sandbox_gets_the_limits_and_environment_of_its_create(
    pooled: LocalProvider,
) -> None:
    async with await AsyncSandbox.create(provider=pooled):
        pass
    await _until(lambda: len(_warm(pooled)) == 2)
    warm = {s.id for s in _warm(pooled)}
    assert all(cgroup_file(s, "cpu", "cpu.shares").strip() == "2" for s in _warm(pooled))
    limits = Limits(memory_mb=96, pids=24, cpus=0.5)
    async with await AsyncSandbox.create(
        provider=pooled, limits=limits, env_vars={"WHO": "me"}, ttl_seconds=600
    ) as box:
        assert box.id in warm
        assert int(cgroup_file(box, "memory", "memory.limit_in_bytes")) == 96 * 1024 * 1024
        assert cgroup_file(box, "pids", "pids.max").strip() == "24"
        assert cgroup_file(box, "cpu", "cpu.cfs_quota_us").strip() == "50000"
        assert cgroup_file(box, "cpu", "cpu.shares").strip() == "1024"  # no longer in the back
        assert (await box.commands.run("echo $WHO")).stdout == "me\n"
        # the pids limit holds in it: fork() is refused before 24 processes
        forks = await box.commands.run("python3 -", stdin=FORK_UNTIL_REFUSED, timeout_seconds=30)
        forked, failure = forks.stdout.split()
        assert failure == "EAGAIN" and 24 - 8 <= int(forked) < 24, forks


async def test_only_the_latest_configurations_keep_a_pool(pooled: LocalProvider) -> None:
    configs = [Limits(disk_mb=16 + i) for i in range(LocalProvider.MAX_POOLED_CONFIGS + 1)]
    ids: set[str] = set()
    for limits in configs:
        async with await AsyncSandbox.create(provider=pooled, limits=limits) as box:
            ids.add(box.id)
        latest = next(reversed(pooled._pools.values()))
        await _until(lambda latest=latest: len([s for s in latest if s.alive]) == 2)
        ids |= {s.id for s in latest}
    assert len(pooled._pools) == LocalProvider.MAX_POOLED_CONFIGS
    assert configs[0].disk_mb not in {key[2] for key in pooled._pools}  # the oldest was dropped
    await _until(lambda: len(_warm(pooled)) == 2 * LocalProvider.MAX_POOLED_CONFIGS)
    await pooled.close()
    assert_no_leftovers(ids)  # the dropped pool's sandboxes too
