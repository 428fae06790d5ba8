"""Host data: files, directories and environment of the host are out of the sandbox's sight."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from _attack_helpers import (
    assert_answers,
    assert_no_leftovers,
    host_canary_file,
    new_sandbox,
    sh,
)

from rollbox.sandbox import _host


@pytest.fixture
def host_canary() -> Iterator[tuple[Path, str]]:
    with host_canary_file() as canary:
        yield canary


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


async def test_host_files_are_not_visible(provider: object, host_canary: tuple[Path, str]) -> None:
    canary, content = host_canary
    shadow_before = sha256("/etc/shadow") if Path("/etc/shadow").exists() else None
    homes = [str(p) for p in Path("/home").iterdir()] if Path("/home").is_dir() else []
    secret_places = [
        "/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/root", str(Path.home()), "/home",
        *homes, str(canary), str(canary.parent), "/run/rollbox", str(_host.state_dir()),
        "/var/run/docker.sock", "/sys/fs/cgroup",
    ]  # fmt: skip
    sb = await new_sandbox(provider)

    result = await sh(
        sb,
        f"""
        for path in {" ".join(secret_places)}; do [ -e "$path" ] && echo "VISIBLE $path"; done
        cat {canary}; echo "canary=$?"
        echo pwned >> {canary}; echo "write=$?"
        # Anywhere but /proc and the (huge, host-read-only) /usr: one grep of /usr takes ~20 s.
        grep -rslD skip "{content[:12]}""{content[12:]}" \\
            $(find / -mindepth 1 -maxdepth 1 ! -type l ! -name proc ! -name usr) | sed 's/^/found: /'
        """,
    )
    out = result.stdout
    assert "VISIBLE" not in out, out
    assert "canary=0" not in out and "write=0" not in out, out
    assert "found: " not in out, out
    assert content not in out + result.stderr
    # What the sandbox does see as /etc/passwd is rollbox's, not the host's.
    passwd = await sh(sb, "cat /etc/passwd")
    assert passwd.stdout != Path("/etc/passwd").read_text()
    assert set(line.split(":")[0] for line in passwd.stdout.splitlines()) == {"root", "sandbox"}

    # The host side is untouched.
    assert canary.read_text() == content
    if shadow_before is not None:
        assert sha256("/etc/shadow") == shadow_before
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_host_environment_does_not_leak(
    provider: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_name = "ROLLBOX_TEST_SECRET"
    secret = f"host-secret-{secrets.token_hex(16)}"
    monkeypatch.setenv(secret_name, secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    sb = await new_sandbox(provider, env_vars={"GIVEN": "visible"})

    # The needle is split so that the command's own text (in /proc/*/cmdline) never holds it.
    needle_a, needle_b = secret[:14], secret[14:]
    result = await sh(
        sb,
        f"""
        env
        for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f 2>/dev/null; done
        cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'
        grep -rslD skip "{needle_a}""{needle_b}" /proc/[0-9]*/environ /work /tmp | sed 's/^/found: /'
        """,
    )
    everything = result.stdout + result.stderr
    assert secret not in everything
    assert secret_name not in everything and "AWS_SECRET_ACCESS_KEY" not in everything
    assert "PYTEST_CURRENT_TEST" not in everything  # nothing of the test process's environment
    assert "GIVEN=visible" in everything  # env_vars given on purpose do arrive
    assert "found: " not in everything
    # PID 1 inside is rollbox's agent, not the host's init.
    init = await sh(sb, "tr '\\0' ' ' < /proc/1/cmdline")
    assert "/.rollbox/agent.py" in init.stdout, init
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_root_filesystem_and_shared_files_are_read_only(provider: object) -> None:
    """Writes anywhere but /work and /tmp fail, the files shared by every sandbox (the agent,
    /etc/passwd) above all; the host copies stay as they were."""
    agent_on_host = provider._agent_path  # type: ignore[attr-defined]
    passwd_on_host = _host.state_dir() / "etc" / "passwd"
    shared_before = sha256(agent_on_host), sha256(passwd_on_host), sha256("/etc/passwd")
    marker = f"rollbox-pwned-{secrets.token_hex(4)}"
    sb = await new_sandbox(provider)

    targets = [
        f"/{marker}",
        f"/usr/{marker}",
        f"/usr/bin/{marker}",
        f"/etc/{marker}",
        f"/.rollbox/{marker}",
        "/.rollbox/agent.py",
        "/.rollbox/bin/python3",
        "/etc/passwd",
        "/etc/hosts",
        "/usr/bin/python3",
    ]
    script = (
        "import errno, sys\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        open(path, 'ab').write(b'pwned')\n"
        "        print(path, 'WRITTEN')\n"
        "    except OSError as exc:\n"
        "        print(path, errno.errorcode[exc.errno])\n"
    )
    await sb.files.write("/work/w.py", script)
    result = await sh(sb, "python3 /work/w.py " + " ".join(targets))
    outcome = dict(line.split() for line in result.stdout.splitlines())
    for path in targets:
        assert outcome[path] in ("EROFS", "EACCES", "EPERM", "ENOENT"), (path, outcome)
    # The same through the file API.
    from rollbox.errors import SandboxFileError

    for path in targets:
        with pytest.raises(SandboxFileError):
            await sb.files.write(path, "pwned")

    assert not Path(f"/{marker}").exists() and not Path(f"/usr/{marker}").exists()
    assert not Path(f"/usr/bin/{marker}").exists() and not Path(f"/etc/{marker}").exists()
    assert (sha256(agent_on_host), sha256(passwd_on_host), sha256("/etc/passwd")) == shared_before
    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})
