"""How the agent starts a command: plain words skip the shell, anything else goes to sh."""

from __future__ import annotations

import os

import pytest

from rollbox.sandbox import _agent

ENV = {"PATH": "/nowhere:/usr/bin:/bin", "HOME": "/work"}


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str], dict[str, str]]]:
    """What the agent asks posix_spawn for (nothing is started)."""
    calls: list[tuple[str, list[str], dict[str, str]]] = []

    def record(path: str, argv: list[str], env: dict[str, str], **_: object) -> int:
        calls.append((path, argv, env))
        return 4242

    monkeypatch.setattr(_agent.os, "posix_spawn", record)
    return calls


def test_plain_words_are_looked_up_in_path_and_executed(spawned: list) -> None:
    assert _agent.spawn_command("ls -la /work x=1 a,b", ENV, 0, 1, 2) == 4242
    path, argv, env = spawned[-1]
    assert path == "/usr/bin/ls" and argv == ["ls", "-la", "/work", "x=1", "a,b"]
    assert env == {**ENV, "PWD": os.getcwd()}  # what sh would have exported
    _agent.spawn_command("./run.sh arg", ENV, 0, 1, 2)
    assert spawned[-1][:2] == ("./run.sh", ["./run.sh", "arg"])


@pytest.mark.parametrize(
    "command",
    [
        "ls | wc -l", "ls; ls", "ls && ls", "ls > out", "A=1 ls", "ls $HOME", "ls *.py",
        "ls ~", "ls  -l", " ls", "ls\nrm x", "ls\t-l", "'ls'", "ls # note", "echo hi", "true",
        "cd /tmp", "exec ls", "if", "definitely-not-a-command", "(ls)", "ls {a,b}", "",
    ],
)  # fmt: skip
def test_everything_else_goes_to_sh(spawned: list, command: str) -> None:
    _agent.spawn_command(command, ENV, 0, 1, 2)
    assert spawned[-1] == ("/bin/sh", ["/bin/sh", "-c", command], ENV)


def test_sh_gets_it_when_the_program_cannot_be_executed(
    spawned: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path: str, argv: list[str], env: dict[str, str], **_: object) -> int:
        spawned.append((path, argv, env))
        if path != "/bin/sh":
            raise OSError(8, "Exec format error")  # a script without #!: sh runs it itself
        return 4343

    monkeypatch.setattr(_agent.os, "posix_spawn", refuse)
    assert _agent.spawn_command("ls /", ENV, 0, 1, 2) == 4343
    assert [call[0] for call in spawned] == ["/usr/bin/ls", "/bin/sh"]
    assert spawned[-1] == ("/bin/sh", ["/bin/sh", "-c", "ls /"], ENV)
