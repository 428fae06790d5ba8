"""Shared fixtures: real local sandboxes, and a check that nothing of them is left behind."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox.sandbox import _host

# Tests count processes, cgroups and records on the machine, which the idle sandboxes of a warm
# pool would muddle: pools are off here (and in the subprocesses tests start) unless a test
# turns one on. tests/sandbox/test_pool.py and the conformance suite's "local-pooled" do.
os.environ.setdefault("ROLLBOX_POOL_SIZE", "0")


def live_leftovers() -> dict[str, list[str]]:
    """What of rollbox's sandboxes is still on the machine: cgroups, state records, bwrap processes."""
    found: dict[str, list[str]] = {"cgroups": [], "records": [], "bwrap": []}
    layout = _host.cgroup_layout()
    if layout is not None:
        for parent in layout.parents.values():
            found["cgroups"] += [str(p) for p in parent.glob("sb-*")]
    records = _host.state_dir() / "sandboxes"
    if records.is_dir():
        found["records"] += [p.name for p in records.glob("*.json")]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().strip() == "bwrap":
                    found["bwrap"].append(proc.name)
            except OSError:
                pass
    return {k: v for k, v in found.items() if v}


def assert_no_leftovers(sandbox_ids: set[str] | None = None) -> None:
    """Fail if a sandbox (all, or those in ``sandbox_ids``) left a cgroup, record or process."""
    leftovers = live_leftovers()
    if sandbox_ids is not None:
        leftovers = {
            k: [v for v in vs if any(i in v for i in sandbox_ids)]
            for k, vs in leftovers.items()
            if k != "bwrap"
        }
        leftovers = {k: v for k, v in leftovers.items() if v}
    assert not leftovers, f"left behind: {leftovers}{_holders(leftovers.get('cgroups', []))}"


def _holders(cgroups: list[str]) -> str:
    """The processes still in leftover cgroups, for the failure message."""
    seen = []
    for cgroup in cgroups:
        for procs in Path(cgroup).rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                seen.append(
                    f"{pid} {stat.split(')')[0].split('(')[-1]} {stat.rsplit(')', 1)[1].split()[0]}"
                )
    return f"; processes in them: {seen}" if cgroups else ""


def reap_until_clean(sandbox_ids: set[str], seconds: float = 30.0) -> None:
    """Run the reaper until the sandboxes are gone, as ``rollbox cleanup`` or the next start would.

    One pass keeps a record whose cgroups are still busy (processes of a killed PID namespace
    can take a moment to exit on a loaded machine) so that a later pass finishes the job.
    """
    from rollbox.sandbox.local import LocalProvider

    deadline = time.monotonic() + seconds
    while True:
        LocalProvider().cleanup()
        try:
            assert_no_leftovers(sandbox_ids)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


@pytest.fixture
async def provider() -> AsyncIterator[object]:
    """A fresh LocalProvider, closed (every sandbox killed) after the test."""
    from rollbox.sandbox.local import LocalProvider

    local = LocalProvider()
    yield local
    await local.close()


@pytest.fixture
async def sandbox(provider: object) -> AsyncIterator[object]:
    """One live sandbox with default settings, killed after the test."""
    from rollbox import AsyncSandbox

    async with await AsyncSandbox.create(provider=provider) as box:  # type: ignore[arg-type]
        yield box


@pytest.fixture(scope="session", autouse=True)
def _no_leaks_after_session() -> object:
    yield
    if os.environ.get("ROLLBOX_SKIP_LEAK_CHECK"):
        return
    import gc

    from rollbox.sandbox.local import LocalProvider

    gc.collect()
    # Warm sandboxes of providers still open (the default providers, when a pool is on) are
    # not leaks: they end with their provider or the process.
    warm = {s.id for s in LocalProvider._live if s.alive and not s._holds_slot}
    # Only what this session owns (or what has no owner at all): other processes on the
    # machine may have live sandboxes of their own.
    mine = set()
    records = _host.state_dir() / "sandboxes"
    for path in records.glob("*.json") if records.is_dir() else ():
        try:
            if json.loads(path.read_text())["owner_pid"] == os.getpid() and path.stem not in warm:
                mine.add(path.stem)
        except (OSError, ValueError, KeyError):
            continue
    leftovers = live_leftovers()
    leftovers.pop("bwrap", None)
    leftovers = {
        kind: [
            item
            for item in items
            if any(i in item for i in mine)
            or (kind == "cgroups" and not (records / f"{Path(item).name}.json").exists())
        ]
        for kind, items in leftovers.items()
    }
    leftovers = {k: v for k, v in leftovers.items() if v}
    assert not leftovers, f"the test session left sandboxes behind: {leftovers}"
