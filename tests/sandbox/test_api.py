"""The public API's surface: names, validation, typed errors that say what to do."""

from __future__ import annotations

import pytest

import rollbox
from rollbox import AsyncSandbox, ConfigError, Limits, NetworkConfig, RollboxError
from rollbox.errors import ProviderNotFoundError
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.models import parse_network_rule


def test_public_names() -> None:
    for name in (
        "AsyncSandbox",
        "Sandbox",
        "NetworkConfig",
        "Limits",
        "ExecResult",
        "RollboxError",
    ):
        assert name in rollbox.__all__ and hasattr(rollbox, name)


def test_every_error_has_one_root() -> None:
    import rollbox.errors as errors

    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert all(issubclass(cls, RollboxError) for cls in classes)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"limits": {"memory_mb": 0}}, "memory_mb"),
        ({"limits": {"pids": -1}}, "pids"),
        ({"limits": {"cpus": 0}}, "cpus"),
        ({"limits": {"surprise": 1}}, "surprise"),
    ],
)
def test_limits_validation(kwargs: dict[str, dict[str, int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Limits(**kwargs["limits"])


@pytest.mark.parametrize("rule", ["10.0.0.0/8", "1.2.3.4", "1.2.3.4:443", "::1/128", "0.0.0.0/0"])
def test_network_rules_accepted(rule: str) -> None:
    parse_network_rule(rule)
    assert NetworkConfig(allow_out=[rule]).enabled


@pytest.mark.parametrize("rule", ["example.com", "1.2.3.4:0", "1.2.3.4:99999", "10.0.0.0/33", ""])
def test_network_rules_rejected(rule: str) -> None:
    with pytest.raises(ValueError, match="network rule"):
        NetworkConfig(allow_out=[rule])


def test_network_default_is_none() -> None:
    assert not NetworkConfig().enabled
    assert not NetworkConfig(deny_out=["0.0.0.0/0"]).enabled


async def test_create_rejects_bad_arguments(provider: LocalProvider) -> None:
    with pytest.raises(ConfigError, match="environment variable"):
        await AsyncSandbox.create(env_vars={"A=B": "x"}, provider=provider)
    with pytest.raises(ConfigError, match="ttl_seconds"):
        await AsyncSandbox.create(ttl_seconds=-1, provider=provider)
    with pytest.raises(ProviderNotFoundError, match="unknown provider 'nope'"):
        await AsyncSandbox.create(provider="nope")


async def test_command_arguments_are_checked(sandbox: AsyncSandbox) -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        await sandbox.commands.run("   ")
    with pytest.raises(ConfigError, match="timeout_seconds"):
        await sandbox.commands.run("true", timeout_seconds=0)
    with pytest.raises(ConfigError, match="environment variable"):
        await sandbox.commands.run("true", env={"": "x"})
    with pytest.raises(ConfigError, match="str or bytes"):
        await sandbox.files.write("/work/x", 42)  # type: ignore[arg-type]


async def test_default_provider_is_local() -> None:
    async with await AsyncSandbox.create(name="default") as sb:
        assert type(sb).provider_name == "local"
        assert sb.info().name == "default"


def test_a_sandbox_used_from_another_loop_is_a_clear_error() -> None:
    import asyncio

    async def make() -> AsyncSandbox:
        return await AsyncSandbox.create(provider=LocalProvider())

    loop = asyncio.new_event_loop()
    sandbox = loop.run_until_complete(make())
    try:
        with pytest.raises(ConfigError, match="event loop"):
            asyncio.run(sandbox.commands.run("true"))
    finally:
        loop.run_until_complete(sandbox.kill())
        loop.close()
    assert not sandbox.alive
