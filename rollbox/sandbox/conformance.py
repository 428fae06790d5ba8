"""The provider contract as reusable async checks.

Every provider must pass every check. A test suite runs them with a ``Harness`` for its
provider::

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    async def test_conformance(check, harness):
        await check(harness)

Each check raises ``AssertionError`` with a message when the provider breaks the contract.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from rollbox.errors import (
    CommandError,
    ConfigError,
    SandboxDeadError,
    SandboxFileError,
    TooManySandboxesError,
)
from rollbox.sandbox.base import AsyncSandbox, Provider
from rollbox.sandbox.models import Limits


@dataclass
class Harness:
    """What the checks need: the provider under test, and a way to make a capped one."""

    provider: Provider
    make_provider: Callable[..., Provider]  # accepts max_sandboxes=

    async def create(self, **kwargs: object) -> AsyncSandbox:
        return await AsyncSandbox.create(provider=self.provider, **kwargs)  # type: ignore[arg-type]


Check = Callable[[Harness], Awaitable[None]]


async def check_files_round_trip(h: Harness) -> None:
    """Text, binary, large and unicode-named files come back exactly; listings are right."""
    async with await h.create() as sb:
        await sb.files.write("/work/hello.txt", "héllo\n")
        assert await sb.files.read_text("/work/hello.txt") == "héllo\n"
        binary = bytes(range(256)) * 4
        await sb.files.write("/work/bin/data.bin", binary)
        assert await sb.files.read("/work/bin/data.bin") == binary
        large = os.urandom(8 * 1024 * 1024)
        await sb.files.write("/tmp/large.bin", large)
        assert await sb.files.read("/tmp/large.bin") == large
        unicode_path = "/work/données/ファイル ✓.txt"
        await sb.files.write(unicode_path, b"x")
        assert await sb.files.read(unicode_path) == b"x"
        seen = await sb.commands.run("cat '/work/données/ファイル ✓.txt' && wc -c < /tmp/large.bin")
        assert seen.stdout == f"x{len(large)}\n", seen
        await sb.files.write("/work/hello.txt", "replaced")  # overwrite truncates
        assert await sb.files.read_text("/work/hello.txt") == "replaced"
        await sb.files.write("relative.txt", "r")  # relative paths are under /work
        assert await sb.files.read_text("/work/relative.txt") == "r"
        entries = {e.name: e for e in await sb.files.list("/work")}
        assert entries["hello.txt"].type == "file" and entries["hello.txt"].size == 8
        assert entries["bin"].type == "dir" and entries["données"].type == "dir"
        assert await sb.files.exists("/work/bin/data.bin")
        assert not await sb.files.exists("/work/nope")


async def check_file_errors_and_remove(h: Harness) -> None:
    """Missing files and directories give SandboxFileError; remove works on files and trees."""
    async with await h.create() as sb:
        for bad in (
            sb.files.read("/work/missing"),
            sb.files.read("/work"),
            sb.files.list("/work/missing"),
        ):
            try:
                await bad
            except SandboxFileError:
                pass
            else:
                raise AssertionError("expected SandboxFileError")
        await sb.files.write("/work/tree/a/b.txt", "b")
        await sb.files.write("/work/tree/c.txt", "c")
        await sb.commands.run("ln -s /work/tree/c.txt /work/tree/link")
        try:
            await sb.files.remove("/work/tree")
        except SandboxFileError:
            pass
        else:
            raise AssertionError("removing a directory without recursive=True must fail")
        await sb.files.remove("/work/tree/c.txt")
        assert not await sb.files.exists("/work/tree/c.txt")
        await sb.files.remove("/work/tree", recursive=True)
        assert not await sb.files.exists("/work/tree")
        try:
            await sb.files.write("", "x")
        except ConfigError:
            pass
        else:
            raise AssertionError("an empty path must be a ConfigError")


async def check_upload_download_dir(h: Harness) -> None:
    """A host tree goes in and comes back out unchanged."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "src"
        (source / "pkg" / "sub").mkdir(parents=True)
        (source / "pkg" / "__init__.py").write_text("X = 1\n")
        (source / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)))
        (source / "run.sh").write_text("#!/bin/sh\necho ran\n")
        (source / "run.sh").chmod(0o755)
        async with await h.create() as sb:
            assert await sb.files.upload_dir(source, "/work/project") == 3
            ran = await sb.commands.run(
                "./run.sh && python3 -B -c 'import pkg; print(pkg.X)'", cwd="/work/project"
            )
            assert ran.stdout == "ran\n1\n", ran
            await sb.commands.run("echo made > /work/project/pkg/sub/new.txt")
            back = Path(tmp) / "back"
            assert await sb.files.download_dir("/work/project", back) == 4
        assert (back / "pkg" / "sub" / "data.bin").read_bytes() == bytes(range(256))
        assert (back / "pkg" / "sub" / "new.txt").read_text() == "made\n"


async def check_cwd_env_stdin(h: Harness) -> None:
    """Commands honour cwd, the sandbox's env_vars, per-command env and stdin."""
    async with await h.create(env_vars={"A": "from-create", "B": "b"}) as sb:
        assert (await sb.commands.run("pwd")).stdout == "/work\n"
        assert (await sb.commands.run("pwd", cwd="/tmp")).stdout == "/tmp\n"
        result = await sb.commands.run("echo $A $B $C", env={"A": "override", "C": "c"})
        assert result.stdout == "override b c\n", result
        assert (await sb.commands.run("cat", stdin="piped\n")).stdout == "piped\n"
        big = b"y" * (1024 * 1024 + 7)
        assert (await sb.commands.run("wc -c", stdin=big)).stdout.strip() == str(len(big))
        assert (await sb.commands.run("cat")).stdout == ""  # no stdin: EOF at once
        try:
            await sb.commands.run("true", cwd="/work/does-not-exist")
        except CommandError:
            pass
        else:
            raise AssertionError("a missing cwd must raise CommandError")


async def check_exit_codes(h: Harness) -> None:
    """Non-zero exits are results with the right code, never exceptions."""
    async with await h.create() as sb:
        assert (await sb.commands.run("true")).exit_code == 0
        assert (await sb.commands.run("exit 3")).exit_code == 3
        missing = await sb.commands.run("definitely-not-a-command")
        assert missing.exit_code == 127 and "not found" in missing.stderr
        assert (await sb.commands.run("kill -9 $$")).exit_code == -9
        both = await sb.commands.run("echo out; echo err >&2; exit 1")
        assert (both.stdout, both.stderr, both.exit_code) == ("out\n", "err\n", 1)
        assert both.duration_s > 0


async def check_plain_commands_run_as_under_sh(h: Harness) -> None:
    """A command of plain words behaves exactly as the same words run by sh as part of a list:
    the program PATH finds, arguments, environment (sh's PWD included), exit code, errors, and
    a script without #!."""
    show = (
        "import os, sys\nprint(sys.executable, sys.argv[1:], os.getcwd(), os.environ.get('PWD'))\n"
    )
    async with await h.create(env_vars={"A": "a"}) as sb:
        await sb.files.write("/work/show.py", show)
        await sb.files.write("/work/bin/hello", "echo hello from a script without a shebang $1\n")
        await sb.commands.run("chmod +x /work/bin/hello")
        for command, cwd in [
            ("python3 show.py x=1 -v a,b %d @home:8 +.", "/work"),
            ("env", "/tmp"),
            ("/work/bin/hello one", "/work"),
            ("bin/hello two", "/work"),
            ("ls /work", "/work"),
            ("definitely-not-a-command x", "/work"),
            ("/work", "/work"),
        ]:
            plain = await sb.commands.run(command, cwd=cwd)
            in_a_list = await sb.commands.run(f": ; {command}", cwd=cwd)
            seen = [
                (r.exit_code, sorted(r.stdout.splitlines()), r.stderr) for r in (plain, in_a_list)
            ]
            assert seen[0] == seen[1], (command, plain, in_a_list)


async def check_timeout_kills_tree(h: Harness) -> None:
    """A timeout kills the command and everything it started, setsid'd orphans included."""
    async with await h.create() as sb:
        result = await sb.commands.run(
            "sleep 101 & setsid sh -c 'sleep 102 &' & (sleep 103 &) ; sleep 104",
            timeout_seconds=0.5,
        )
        assert result.timed_out and result.exit_code == -9, result
        survivors = await sb.commands.run("ps -eo args | grep -E '^sleep 10[1-4]' || true")
        assert survivors.stdout == "", f"processes survived the timeout: {survivors.stdout}"


async def check_background_processes(h: Harness) -> None:
    """Spawned processes and `&` jobs live across commands until killed."""
    async with await h.create() as sb:
        server = await sb.commands.spawn(
            "python3 -m http.server 8765 --bind 127.0.0.1", cwd="/work"
        )
        await sb.files.write("/work/index.html", "served")
        fetch = (
            'python3 -c "import urllib.request,time\n'
            "for i in range(100):\n"
            "    try: print(urllib.request.urlopen('http://127.0.0.1:8765/index.html').read().decode()); break\n"
            '    except OSError: time.sleep(0.05)"'
        )
        got = await sb.commands.run(fetch)
        assert got.stdout == "served\n", got
        _, stderr = await server.logs()
        assert "GET /index.html" in stderr
        await server.kill()
        ended = await asyncio.wait_for(server.wait(), 10)
        assert ended.exit_code == -9
        # a job left running by one command is still there for the next one
        await sb.commands.run("nohup sleep 300 >/dev/null 2>&1 &")
        assert "sleep 300" in (await sb.commands.run("ps -eo args")).stdout


async def check_streaming(h: Harness) -> None:
    """on_stdout/on_stderr receive output while the command runs, in order."""
    async with await h.create() as sb:
        out: list[str] = []
        err: list[str] = []
        result = await sb.commands.run(
            "for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.05; done",
            on_stdout=out.append,
            on_stderr=err.append,
        )
        assert "".join(out) == "o1\no2\no3\n" == result.stdout
        assert "".join(err) == "e1\ne2\ne3\n" == result.stderr
        assert len(out) >= 2, "output should arrive in pieces as it is printed"


async def check_truncation(h: Harness) -> None:
    """Output past Limits.output_bytes is dropped and flagged."""
    async with await h.create(limits=Limits(output_bytes=1000)) as sb:
        result = await sb.commands.run("head -c 200000 /dev/zero | tr '\\0' a; echo err >&2")
        assert result.truncated and len(result.stdout) == 1000 and result.exit_code == 0
        assert result.stderr == "err\n"
        small = await sb.commands.run("echo fits")
        assert not small.truncated


async def check_persistence_and_concurrency(h: Harness) -> None:
    """Files persist between commands; many commands run at once in one sandbox."""
    async with await h.create() as sb:
        await sb.commands.run("echo 1 > /work/state")
        assert (await sb.commands.run("cat /work/state")).stdout == "1\n"
        results = await asyncio.gather(
            *(sb.commands.run(f"sleep 0.2; echo {i}") for i in range(10))
        )
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]


async def check_kill_all(h: Harness) -> None:
    """commands.kill_all stops every process, background and setsid'd ones too; the sandbox lives."""
    async with await h.create() as sb:
        await sb.commands.spawn("sleep 1001")
        await sb.commands.run("nohup sleep 1002 >/dev/null 2>&1 & setsid sh -c 'sleep 1003 &'")
        await sb.commands.kill_all()
        left = await sb.commands.run("ps -eo args | grep -E '^sleep 100[1-3]' || true")
        assert left.stdout == "", f"survived kill_all: {left.stdout}"
        assert (await sb.commands.run("echo alive")).stdout == "alive\n"


async def check_kill_idempotent(h: Harness) -> None:
    """kill twice is fine; a killed sandbox raises SandboxDeadError."""
    sb = await h.create()
    assert sb.alive
    await sb.kill()
    await sb.kill()
    assert not sb.alive
    for call in (sb.commands.run("true"), sb.files.read("/work/x")):
        try:
            await call
        except SandboxDeadError:
            pass
        else:
            raise AssertionError("a killed sandbox must raise SandboxDeadError")


async def check_context_manager(h: Harness) -> None:
    """`async with` kills the sandbox on exit, also when the body raises."""
    async with await h.create() as sb:
        assert sb.alive
    assert not sb.alive
    try:
        async with await h.create() as sb2:
            raise KeyError("boom")
    except KeyError:
        pass
    assert not sb2.alive


async def check_running_command_when_killed(h: Harness) -> None:
    """A command running when its sandbox is killed raises SandboxDeadError, not hang."""
    sb = await h.create()
    process = await sb.commands.spawn("sleep 60")
    await sb.kill()
    try:
        await asyncio.wait_for(process.wait(), 10)
    except SandboxDeadError:
        pass
    else:
        raise AssertionError("waiting on a command of a killed sandbox must raise")


async def check_ttl(h: Harness) -> None:
    """The backend kills a sandbox whose TTL ran out, without anyone calling kill."""
    sb = await h.create(ttl_seconds=0.5)
    deadline = time.monotonic() + 15
    while sb.alive and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not sb.alive, "the TTL did not kill the sandbox"
    try:
        await sb.commands.run("true")
    except SandboxDeadError as exc:
        assert "TTL" in str(exc), str(exc)
    else:
        raise AssertionError("an expired sandbox must raise SandboxDeadError")


async def check_concurrency_cap(h: Harness) -> None:
    """Past the cap, create waits for a slot, or raises TooManySandboxesError if told not to."""
    provider = h.make_provider(max_sandboxes=2)
    try:
        first = await AsyncSandbox.create(provider=provider)
        second = await AsyncSandbox.create(provider=provider)
        try:
            await AsyncSandbox.create(provider=provider, wait_for_slot=False)
        except TooManySandboxesError:
            pass
        else:
            raise AssertionError("create past the cap with wait_for_slot=False must raise")
        try:
            await AsyncSandbox.create(provider=provider, slot_timeout_seconds=0.2)
        except TooManySandboxesError:
            pass
        else:
            raise AssertionError("create past the cap must time out waiting")
        waiting = asyncio.ensure_future(AsyncSandbox.create(provider=provider))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "create past the cap must wait"
        await first.kill()
        third = await asyncio.wait_for(waiting, 15)
        assert third.alive and second.alive
        assert len(await provider.list()) == 2
    finally:
        await provider.close()


async def check_list_and_get(h: Harness) -> None:
    """The provider lists live sandboxes and finds them by id."""
    async with await h.create(name="listed") as sb:
        infos = {info.id: info for info in await h.provider.list()}
        assert sb.id in infos and infos[sb.id].name == "listed"
        assert infos[sb.id].template_id
        assert (await h.provider.get(sb.id)) is sb
    assert sb.id not in {info.id for info in await h.provider.list()}


CHECKS: list[Check] = [
    check_files_round_trip,
    check_file_errors_and_remove,
    check_upload_download_dir,
    check_cwd_env_stdin,
    check_exit_codes,
    check_plain_commands_run_as_under_sh,
    check_timeout_kills_tree,
    check_background_processes,
    check_streaming,
    check_truncation,
    check_persistence_and_concurrency,
    check_kill_all,
    check_kill_idempotent,
    check_context_manager,
    check_running_command_when_killed,
    check_ttl,
    check_concurrency_cap,
    check_list_and_get,
]
