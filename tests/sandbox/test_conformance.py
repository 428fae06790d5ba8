"""Every provider that can start on this machine passes the same contract."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

from rollbox.errors import BackendUnavailableError
from rollbox.sandbox.conformance import CHECKS, Check, Harness


def _local(**kwargs: object):  # type: ignore[no-untyped-def]
    from rollbox.sandbox.local import LocalProvider

    return LocalProvider(pool_size=0, **kwargs)  # type: ignore[arg-type]


def _local_pooled(**kwargs: object):  # type: ignore[no-untyped-def]
    """The local provider as users get it by default: two sandboxes booted ahead."""
    from rollbox.sandbox.local import LocalProvider

    return LocalProvider(pool_size=2, **kwargs)  # type: ignore[arg-type]


def _docker(**kwargs: object):  # type: ignore[no-untyped-def]
    from rollbox.sandbox.docker import DockerProvider

    return DockerProvider(**kwargs)  # type: ignore[arg-type]


def _ray(**kwargs: object):  # type: ignore[no-untyped-def]
    from rollbox.sandbox.ray import RayProvider
    from tests.sandbox._ray import ray_cluster

    ray_cluster()  # two nodes on this machine, shared by this module's tests
    return RayProvider(**kwargs)  # type: ignore[arg-type]


PROVIDERS = {"local": _local, "local-pooled": _local_pooled, "docker": _docker, "ray": _ray}


@pytest.fixture(scope="module", autouse=True)
def _stop_ray_cluster() -> Iterator[None]:
    yield
    if "tests.sandbox._ray" in sys.modules:
        sys.modules["tests.sandbox._ray"].stop_ray_cluster()


@pytest.fixture(
    params=[
        pytest.param(name, marks=[pytest.mark.docker] if name == "docker" else [])
        for name in sorted(PROVIDERS)
    ]
)
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    make = PROVIDERS[request.param]
    try:
        provider = make()
    except BackendUnavailableError as exc:
        if os.environ.get("CI"):  # CI starts what every provider needs: nothing is skipped there
            pytest.fail(f"{request.param} provider cannot start in CI: {exc}")
        pytest.skip(f"{request.param} provider cannot start here: {exc}")
    yield Harness(provider=provider, make_provider=make)
    await provider.close()


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
async def test_conformance(check: Check, harness: Harness) -> None:
    await check(harness)
