"""Templates: the built-in python template and a root filesystem directory."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbox import AsyncSandbox, ConfigError
from rollbox.sandbox import _host
from rollbox.sandbox.local import LocalProvider


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A root filesystem made of hard links to the host's /usr (about 2 s), plus a marker."""
    base = Path("/var/tmp") / f"rollbox-test-rootfs-{os.getpid()}"
    base.mkdir(mode=0o755)
    try:
        subprocess.run(["cp", "-al", "/usr", str(base / "usr")], check=True)
        for name in ("bin", "sbin", "lib", "lib64"):
            if (base / "usr" / name).exists():
                (base / name).symlink_to(f"usr/{name}")
        (base / "etc").mkdir()
        (base / "etc" / "marker").write_text("from the template\n")
        # a directory the sandbox user owns: writable through the sandbox's own overlay layer
        (base / "srv").mkdir()
        os.chown(base / "srv", _host.SANDBOX_UID, _host.SANDBOX_UID)
        yield base
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)


async def test_python_template_has_host_python_and_read_only_root(sandbox: AsyncSandbox) -> None:
    result = await sandbox.commands.run("python --version && python3 -c 'import json, sqlite3'")
    assert result.exit_code == 0 and result.stdout.startswith("Python 3"), result
    for path in ("/x", "/usr/x", "/etc/x"):
        denied = await sandbox.commands.run(f"touch {path}")
        assert denied.exit_code != 0, f"{path} must not be writable"
    assert sandbox.template_id.startswith("python:")


async def test_rootfs_template_gets_its_own_layer(provider: LocalProvider, rootfs: Path) -> None:
    async with (
        await AsyncSandbox.create(from_template=str(rootfs), provider=provider) as first,
        await AsyncSandbox.create(from_template=str(rootfs), provider=provider) as second,
    ):
        assert (await first.commands.run("cat /etc/marker")).stdout == "from the template\n"
        wrote = await first.commands.run("echo mine > /srv/state && cat /srv/state")
        assert wrote.stdout == "mine\n", wrote
        # the write went to the first sandbox's layer: not to the template, not to the second
        assert not (rootfs / "srv" / "state").exists()
        assert (await second.commands.run("ls /srv")).stdout == ""
        assert (await first.commands.run("python3 -c 'print(6*7)'")).stdout == "42\n"
        assert first.template_id.startswith("dir:") and first.template_id == second.template_id


async def test_the_agent_cannot_plant_tools_first_on_path(
    provider: LocalProvider, rootfs: Path
) -> None:
    # /.rollbox/bin comes first on PATH; on a template with a writable root it must still be
    # read-only, or a planted python3 would run in every later command (the verifier's too).
    async with await AsyncSandbox.create(from_template=str(rootfs), provider=provider) as sb:
        plant = await sb.commands.run(
            "mkdir -p /.rollbox/bin && printf '#!/bin/sh\\necho HIJACKED\\n' > /.rollbox/bin/python3"
            " && chmod +x /.rollbox/bin/python3"
        )
        assert plant.exit_code != 0, plant
        assert (await sb.commands.run("python3 -c 'print(1)'")).stdout == "1\n"


async def test_bad_templates_are_config_errors(provider: LocalProvider, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither 'python' nor"):
        await AsyncSandbox.create(from_template="no-such-template", provider=provider)
    with pytest.raises(ConfigError, match="python3"):
        await AsyncSandbox.create(from_template=str(tmp_path), provider=provider)


async def test_the_python_template_runs_the_agent_from_bytecode(sandbox: AsyncSandbox) -> None:
    """Compiled once by the template's interpreter on the host, not at every sandbox start."""
    cmdline = (await sandbox.commands.run("tr '\\0' ' ' < /proc/1/cmdline")).stdout
    assert "/.rollbox/agent.pyc" in cmdline, cmdline
    # the bytecode is not writable from inside (it is shared by every sandbox)
    attempt = await sandbox.commands.run("echo x >> /.rollbox/agent.pyc")
    assert attempt.exit_code != 0


async def test_the_agent_source_is_used_where_it_cannot_be_compiled(
    provider: LocalProvider, rootfs: Path
) -> None:
    from rollbox.sandbox.local import _compile_agent

    assert _compile_agent("/no/such/python", "x", provider._agent_path) is False
    # a root filesystem template's interpreter is not run on the host: the source it is
    async with await AsyncSandbox.create(from_template=str(rootfs), provider=provider) as box:
        cmdline = (await box.commands.run("tr '\\0' ' ' < /proc/1/cmdline")).stdout
        assert "/.rollbox/agent.py " in cmdline, cmdline
