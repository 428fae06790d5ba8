"""provider="remote" passes the same contract as the local backend, against a real server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rollbox.sandbox.conformance import CHECKS, Check, Harness
from rollbox.sandbox.remote import RemoteProvider
from tests.server.conftest import ServerProcess


@pytest.fixture
async def harness(server: ServerProcess) -> AsyncIterator[Harness]:
    def make(**kwargs: object) -> RemoteProvider:
        return RemoteProvider(server.url, **kwargs)  # type: ignore[arg-type]

    provider = make()
    yield Harness(provider=provider, make_provider=make)
    await provider.close()
    stats = server.wait_until_idle()
    assert stats["sandboxes"] == 0, f"the server still holds sandboxes: {stats}"


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
async def test_remote_conformance(check: Check, harness: Harness) -> None:
    await check(harness)
