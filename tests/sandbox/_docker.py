"""The Docker Engine for tests: found like the provider finds it (DOCKER_HOST, else the socket).

``.ci/run`` starts a dockerd and exports DOCKER_HOST, so in CI (``CI`` set) a missing Engine
fails the tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator

import pytest

from rollbox.sandbox.docker import DockerEngineError, DockerProvider


def make_docker_provider(**kwargs: object) -> DockerProvider:
    """A DockerProvider, or a skip (a failure in CI) where no Engine answers."""
    try:
        return DockerProvider(**kwargs)  # type: ignore[arg-type]
    except DockerEngineError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"no Docker Engine in CI: {exc}")
        pytest.skip(f"no Docker Engine here: {exc}")


def containers_of(provider: DockerProvider) -> list[dict[str, object]]:
    """The rollbox containers this process owns on the Engine, running or not."""
    filters = json.dumps({"label": [f"rollbox.owner={provider.owner}"]})
    return provider.client.sync_call(
        "GET", "/containers/json", params={"all": "1", "filters": filters}
    ).json()


@pytest.fixture
async def docker_provider() -> AsyncIterator[DockerProvider]:
    """A DockerProvider, closed after the test; fails if the test left a container behind."""
    provider = make_docker_provider()
    yield provider
    await provider.close()
    left = [c["Names"] for c in containers_of(provider)]
    assert not left, f"containers left behind: {left}"
