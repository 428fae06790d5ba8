"""The async episode core, with real sandboxes: reset, step, tools, ends of episodes, scoring."""

from __future__ import annotations

import gc
import json
import string
from pathlib import Path
from typing import Any

import pytest

from rollbox.envs import AsyncSandboxEnv, Task, TaskSetupError
from rollbox.envs.text import charset
from rollbox.errors import ConfigError, SandboxDeadError
from rollbox.rewards import RewardResult
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.models import Limits
from tests.conftest import assert_no_leftovers
from tests.envs.conftest import answer_task


async def test_reset_places_files_runs_setup_and_returns_the_instruction(
    provider: LocalProvider,
) -> None:
    task = answer_task(
        files={"data/in.txt": "7\n", "/tmp/tool.sh": {"content": "echo tool\n", "mode": 0o755}},
        setup=["cp data/in.txt copied.txt", "echo ready > setup.log"],
    )
    async with AsyncSandboxEnv(task, provider=provider) as env:
        obs, info = await env.reset()
        assert obs == task.instruction
        assert info["task_id"] == "answer" and info["turn"] == 0
        assert info["sandbox_id"] == env.sandbox.id
        assert info["template"] == "python" and info["template_id"].startswith("python:")
        assert info["max_turns"] == 10
        assert [s["exit_code"] for s in info["setup"]] == [0, 0]
        obs, *_ = await env.step("cat copied.txt setup.log; /tmp/tool.sh; stat -c %a /tmp/tool.sh")
        assert "7\nready\ntool\n755" in obs
    assert_no_leftovers({info["sandbox_id"]})


async def test_failing_setup_is_an_error_with_its_output(provider: LocalProvider) -> None:
    task = answer_task(setup=["true", "echo building; echo 'no compiler' >&2; exit 3"])
    env = AsyncSandboxEnv(task, provider=provider)
    with pytest.raises(TaskSetupError, match="exited with 3") as caught:
        await env.reset()
    assert "building" in str(caught.value) and "no compiler" in caught.value.output
    assert caught.value.task_id == "answer"
    assert env.sandbox is None
    assert caught.value.sandbox_id is not None
    assert_no_leftovers({caught.value.sandbox_id})


async def test_unplaceable_file_is_a_setup_error(provider: LocalProvider) -> None:
    env = AsyncSandboxEnv(answer_task(files={"/usr/x.txt": "x"}), provider=provider)
    with pytest.raises(TaskSetupError, match=r"cannot place file '/usr/x.txt'.*read-only"):
        await env.reset()


async def test_setup_timeout_is_an_error(provider: LocalProvider) -> None:
    env = AsyncSandboxEnv(
        answer_task(setup=["sleep 30"], setup_timeout_seconds=0.5), provider=provider
    )
    with pytest.raises(TaskSetupError, match=r"timed out after 0\.5 s"):
        await env.reset()


async def test_command_observation(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(), provider=provider) as env:
        await env.reset()
        obs, reward, terminated, truncated, info = await env.step("echo out; echo err >&2; exit 3")
        assert obs.splitlines() == [
            obs.splitlines()[0],
            "--- stdout ---",
            "out",
            "--- stderr ---",
            "err",
        ]
        assert obs.startswith("exit code: 3 (") and " s)" in obs.splitlines()[0]
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert info["tool"] == "bash" and info["exit_code"] == 3 and info["timed_out"] is False
        assert info["turn"] == 1 and info["duration_s"] >= 0 and info["elapsed_s"] >= 0
        obs, *_ = await env.step("true")
        assert obs.endswith("(no output)")
        obs, *_ = await env.step("   ")
        assert obs == "error: empty command"


async def test_output_is_truncated_with_a_clear_mark(provider: LocalProvider) -> None:
    env = AsyncSandboxEnv(
        answer_task(limits=Limits(output_bytes=50_000)), provider=provider, max_output_chars=1000
    )
    async with env:
        await env.reset()
        obs, *_ = await env.step("python3 -c \"print('a' * 20000 + 'z' * 20000)\"")
        assert "[... 39,001 characters truncated ...]" in obs
        assert "a" * 450 in obs and "z" * 450 in obs and len(obs) < 1200
        obs, *_ = await env.step("python3 -c \"print('b' * 60000)\"")
        assert "[output beyond the sandbox's cap of 50,000 bytes per stream was dropped]" in obs
        assert "characters truncated" in obs


async def test_output_is_sanitized_to_the_charset(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(), provider=provider) as env:
        await env.reset()
        obs, *_ = await env.step(
            r"printf '\033[31mred\033[0m\r\nbell\007 \360\237\230\200 caf\303\251\n'"
        )
        assert "red\nbell\ufffd \ufffd café" in obs
        assert set(obs) <= charset()


async def test_background_process_survives_between_steps(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(), provider=provider) as env:
        await env.reset()
        obs, *_ = await env.step(
            "python3 -m http.server 8123 --bind 127.0.0.1 >/tmp/server.log 2>&1 & echo $! > pid"
        )
        assert obs.startswith("exit code: 0")
        fetch = (
            'python3 -c "import time, urllib.request\n'
            "for _ in range(100):\n"
            "    try: print(urllib.request.urlopen('http://127.0.0.1:8123/pid').read().decode()); break\n"
            '    except OSError: time.sleep(0.1)"'
        )
        obs, *_ = await env.step(fetch)
        pid = (await env.sandbox.files.read_text("/work/pid")).strip()
        assert pid in obs
        obs, *_ = await env.step(f"kill -0 {pid} && echo alive")
        assert "alive" in obs


async def test_tool_calls(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(max_turns=20), provider=provider) as env:
        await env.reset()
        obs, _, _, _, info = await env.step(
            {"tool": "write_file", "path": "notes/a.txt", "content": "héllo\n"}
        )
        assert obs == "wrote 7 bytes to /work/notes/a.txt"
        assert info["tool"] == "write_file" and info["exit_code"] is None
        obs, _, _, _, info = await env.step({"tool": "read_file", "path": "/work/notes/a.txt"})
        assert obs == "héllo\n" and info["tool"] == "read_file"
        obs, *_ = await env.step(json.dumps({"tool": "bash", "command": "wc -c notes/a.txt"}))
        assert "7 notes/a.txt" in obs
        obs, *_ = await env.step({"tool": "read_file", "path": "missing.txt"})
        assert obs == (
            "error: read_file: cannot open '/work/missing.txt' for reading: "
            "No such file or directory"
        )
        obs, *_ = await env.step({"tool": "read_file", "path": "/dev/zero"})
        assert "[the file goes on past" in obs and "characters truncated" in obs
        obs, *_ = await env.step({"tool": "write_file", "path": "/usr/x", "content": "x"})
        assert obs.startswith("error: write /usr/x: read-only")
        obs, *_ = await env.step({"tool": "write_file", "path": "", "content": "x"})
        assert obs.startswith("error: sandbox path")
        obs, _, _, _, info = await env.step({"tool": "delete_everything"})
        assert obs.startswith("error: invalid tool call: unknown tool 'delete_everything'")
        assert info["tool"] == "invalid" and info["turn"] == 8
        obs, *_ = await env.step({"tool": "read_file"})
        assert "path: Field required" in obs
        obs, *_ = await env.step({"tool": "write_file", "path": "b\x1b[2Jad\x07", "content": "x"})
        assert obs == "wrote 1 bytes to /work/bad\ufffd"  # escapes stripped, controls replaced
        obs, *_ = await env.step({"tool": "write_file", "path": "empty", "content": ""})
        obs, *_ = await env.step({"tool": "read_file", "path": "empty"})
        assert obs == "(empty file)"


async def test_garbage_collection_kills_the_sandbox(provider: LocalProvider) -> None:
    env = AsyncSandboxEnv(answer_task(), provider=provider)
    _, info = await env.reset()
    await env.step("sleep 1000 &")
    del env
    gc.collect()
    assert_no_leftovers({info["sandbox_id"]})


async def test_long_command_runs_through_a_script(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(), provider=provider) as env:
        await env.reset()
        payload = "é" * 150_000  # 300 KB of UTF-8: more than one argv string may hold
        obs, *_ = await env.step(
            f"x='{payload}'; printf %s \"$x\" | wc -c; ls -A /tmp | grep -c rollbox-command"
        )
        assert obs.endswith("--- stdout ---\n300000\n0")  # and the script removed itself


async def test_submit_scores_and_ends_the_episode(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(), provider=provider) as env:
        await env.reset()
        sandbox_id = env.sandbox.id
        await env.step("echo 42 > answer.txt")
        obs, reward, terminated, truncated, info = await env.step({"tool": "submit"})
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert obs == "submitted\n[episode over: the agent submitted]"
        assert info["termination"] == "submit"
        assert info["reward_components"] == {"tests": 1.0}
        assert info["verifier"]["exit_code"] == 0
        assert info["sandbox_id"] == sandbox_id and info["turn"] == 2
        assert env.sandbox is None
        assert_no_leftovers({sandbox_id})
        with pytest.raises(ConfigError, match="this episode is over: call reset"):
            await env.step("true")

        await env.reset()
        await env.step("echo 41 > answer.txt")
        _, reward, terminated, _, info = await env.step('{"tool": "submit"}')
        assert (reward, terminated) == (0.0, True)
        assert info["reward_components"] == {"tests": 0.0}
        assert info["verifier"]["exit_code"] != 0


async def test_max_turns_truncates_and_still_scores(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(max_turns=2), provider=provider) as env:
        await env.reset()
        assert (await env.step("echo 42 > answer.txt"))[3] is False
        obs, reward, terminated, truncated, info = await env.step("echo done")
        assert (reward, terminated, truncated) == (1.0, False, True)
        assert info["termination"] == "max_turns"
        assert obs.endswith("[episode over: max_turns reached]")


async def test_episode_time_budget_truncates(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(episode_timeout_seconds=1.0), provider=provider) as env:
        await env.reset()
        obs, reward, terminated, truncated, info = await env.step("sleep 30")
        assert (terminated, truncated) == (False, True)
        assert info["termination"] == "time_budget" and info["timed_out"] is True
        assert "timed out" in obs and obs.endswith(
            "[episode over: the episode's time budget ran out]"
        )
        assert reward == 0.0


async def test_step_timeout_kills_the_command_but_not_the_episode(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(step_timeout_seconds=0.5), provider=provider) as env:
        await env.reset()
        obs, _, terminated, truncated, info = await env.step("sleep 30; echo never")
        assert info["timed_out"] is True and info["exit_code"] == -9
        assert "timed out: the command and every process it started were killed" in obs
        assert not terminated and not truncated
        obs, *_ = await env.step("echo still here")
        assert "still here" in obs


async def test_done_condition_terminates(provider: LocalProvider) -> None:
    task = answer_task(done_command="test -f /work/answer.txt")
    async with AsyncSandboxEnv(task, provider=provider) as env:
        await env.reset()
        assert (await env.step("echo working"))[2] is False
        _, reward, terminated, truncated, info = await env.step("echo 42 > answer.txt")
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert info["termination"] == "done_condition"


async def test_shaping_gives_intermediate_rewards(provider: LocalProvider) -> None:
    seen: list[int] = []

    async def shaping(sandbox: Any, task: Task, info: dict[str, Any]) -> float:
        seen.append(info["turn"])
        return 0.25 if await sandbox.files.exists("/work/answer.txt") else 0.0

    async with AsyncSandboxEnv(answer_task(shaping=shaping), provider=provider) as env:
        await env.reset()
        assert (await env.step("true"))[1] == 0.0
        assert (await env.step("echo 42 > answer.txt"))[1] == 0.25
        assert (await env.step({"tool": "submit"}))[1] == 1.0
    assert seen == [1, 2]


async def test_without_shaping_intermediate_rewards_are_zero(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(), provider=provider) as env:
        await env.reset()
        rewards = [(await env.step("echo 42 > answer.txt"))[1] for _ in range(3)]
        assert rewards == [0.0, 0.0, 0.0]


async def test_callable_verifiers(provider: LocalProvider) -> None:
    async def async_verifier(sandbox: Any, task: Task) -> RewardResult:
        text = await sandbox.files.read_text("/work/answer.txt")
        ok = float(text.strip() == "42")
        return RewardResult(score=ok, components={"answer": ok}, details={"seen": text})

    def sync_verifier(sandbox: Any, task: Task) -> float:
        return 0.5

    for verifier, reward, components in (
        (async_verifier, 1.0, {"answer": 1.0}),
        (sync_verifier, 0.5, {"sync_verifier": 0.5}),
    ):
        async with AsyncSandboxEnv(answer_task(verifier=verifier), provider=provider) as env:
            await env.reset()
            await env.step("echo 42 > answer.txt")
            _, got, _, _, info = await env.step({"tool": "submit"})
            assert got == reward and info["reward_components"] == components


async def test_no_verifier_scores_zero(provider: LocalProvider) -> None:
    async with AsyncSandboxEnv(answer_task(verifier=None), provider=provider) as env:
        await env.reset()
        _, reward, terminated, _, info = await env.step({"tool": "submit"})
        assert (reward, terminated) == (0.0, True) and info["reward_components"] == {}


async def test_hidden_tests_cannot_be_read_by_the_agent(provider: LocalProvider) -> None:
    """The hidden files are absent during the episode, and a thief left running is killed first."""
    check = (
        "import os\n"
        "stolen = open('/work/stolen', 'rb').read() if os.path.exists('/work/stolen') else b''\n"
        "assert b'SECRET' not in stolen, stolen\n"
        "others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())]\n"
        "cmds = [open(f'/proc/{p}/cmdline', 'rb').read() for p in others]\n"
        "assert not any(b'thief' in c for c in cmds), cmds\n"
        "assert os.getcwd() == os.environ['TESTS_DIR'], os.getcwd()\n"
        "assert os.environ['TESTS_DIR'].startswith('/tmp/.rollbox-verifier-')\n"
    )
    task = answer_task(
        verifier={
            "command": 'python3 "$TESTS_DIR/check.py"',
            "files": {"check.py": check, "expected.txt": "SECRET-ANSWER-1234\n"},
        }
    )
    thief = (
        "import glob, os, shutil, sys, time\n"
        "sys.argv[0] = 'thief'\n"
        "while True:\n"
        "    for path in glob.glob('/tmp/.rollbox-verifier-*/*') + glob.glob('/tmp/*/*.txt'):\n"
        "        try: shutil.copy(path, '/work/stolen')\n"
        "        except OSError: pass\n"
        "    time.sleep(0.001)\n"
    )
    async with AsyncSandboxEnv(task, provider=provider) as env:
        await env.reset()
        await env.step({"tool": "write_file", "path": "/tmp/thief.py", "content": thief})
        obs, *_ = await env.step(
            "setsid nohup python3 /tmp/thief.py thief >/dev/null 2>&1 & echo ok"
        )
        obs, *_ = await env.step(
            "grep -rl SECRET /tmp /work 2>/dev/null; "
            "find / /tmp /work -xdev -name '*rollbox-verifier*' 2>/dev/null; echo searched"
        )
        assert "searched" in obs and "SECRET" not in obs and "rollbox-verifier" not in obs
        obs, *_ = await env.step("ps -eo args | grep -c '[t]hief'")
        assert "1" in obs  # the thief is running
        _, reward, _, _, info = await env.step({"tool": "submit"})
        assert reward == 1.0, info["verifier"]


async def test_the_agent_home_cannot_reach_into_the_verifier(provider: LocalProvider) -> None:
    # A usercustomize.py in the agent's HOME would run in every Python the tests start.
    task = answer_task(verifier={"command": "python3 -c 'import sys; sys.exit(1)'"})
    plant = (
        "d=$(python3 -c 'import site; print(site.getusersitepackages())') && mkdir -p $d && "
        "printf 'import os\\nos._exit(0)\\n' > $d/usercustomize.py && "
        "python3 -c 'import sys; sys.exit(1)'; echo planted-$?"
    )
    async with AsyncSandboxEnv(task, provider=provider) as env:
        await env.reset()
        obs, *_ = await env.step(plant)
        assert "planted-0" in obs  # the plant works for the agent's own commands
        _, reward, *_ = await env.step({"tool": "submit"})
        assert reward == 0.0


async def test_stdin_nonce_stops_early_exit(provider: LocalProvider) -> None:
    for command, reward in (("exit 0", 0.0), ("read nonce; echo $nonce", 1.0)):
        task = answer_task(verifier={"command": command, "stdin_nonce": True})
        async with AsyncSandboxEnv(task, provider=provider) as env:
            await env.reset()
            _, got, _, _, info = await env.step({"tool": "submit"})
            assert got == reward, info
            assert info["verifier"]["nonce_confirmed"] is bool(reward)


async def test_pids_held_by_the_agent_do_not_stop_scoring(provider: LocalProvider) -> None:
    # Every pid is taken, so no process could start to stop the agent's: the sandbox's init
    # kills them without forking, and the hidden tests still run.
    task = answer_task(limits=Limits(pids=24), verifier={"command": "echo scored"})
    hog = (
        "parent=$$\n"
        # takes the pid this shell frees when it exits, so that none is left
        "(while kill -0 $parent 2>/dev/null; do :; done; sleep 1000 & exec sleep 1000) "
        ">/dev/null 2>&1 &\n"
        "for i in $(seq 40); do sleep 1000 & done 2>/dev/null\n"
    )
    async with AsyncSandboxEnv(task, provider=provider) as env:
        await env.reset()
        await env.step(hog)
        blocked, *_ = await env.step("echo can-start")
        assert "could not start" in blocked  # the pids are held: nothing can fork
        _, reward, terminated, _, info = await env.step({"tool": "submit"})
        assert (reward, terminated) == (1.0, True), info


async def test_an_exception_in_step_kills_the_sandbox(provider: LocalProvider) -> None:
    def shaping(sandbox: Any, task: Task, info: dict[str, Any]) -> float:
        raise RuntimeError("shaping bug")

    env = AsyncSandboxEnv(answer_task(shaping=shaping), provider=provider)
    await env.reset()
    sandbox_id = env.sandbox.id
    with pytest.raises(RuntimeError, match="shaping bug"):
        await env.step("sleep 1000 &")
    assert env.sandbox is None
    assert_no_leftovers({sandbox_id})
    with pytest.raises(ConfigError, match="episode is over"):
        await env.step("true")

    await env.reset()
    sandbox_id = env.sandbox.id
    with pytest.raises(ConfigError, match="not int"):
        await env.step(42)
    assert_no_leftovers({sandbox_id})


async def test_a_bad_verifier_result_is_an_error(provider: LocalProvider) -> None:
    env = AsyncSandboxEnv(answer_task(verifier=lambda sandbox, task: "yes"), provider=provider)
    await env.reset()
    sandbox_id = env.sandbox.id
    with pytest.raises(ConfigError, match="return a float or a RewardResult"):
        await env.step({"tool": "submit"})
    assert_no_leftovers({sandbox_id})


async def test_a_dead_sandbox_is_an_error_not_an_observation(provider: LocalProvider) -> None:
    env = AsyncSandboxEnv(answer_task(), provider=provider)
    await env.reset()
    await env.sandbox.kill()
    with pytest.raises(SandboxDeadError):
        await env.step("echo hi")
    assert env.sandbox is None


async def test_reset_kills_the_previous_sandbox_and_close_leaves_nothing(
    provider: LocalProvider,
) -> None:
    env = AsyncSandboxEnv(answer_task(), provider=provider)
    await env.reset()
    first = env.sandbox.id
    await env.step("sleep 1000 &")
    await env.reset()
    second = env.sandbox.id
    assert first != second
    assert_no_leftovers({first})
    await env.close()
    await env.close()  # idempotent
    assert env.sandbox is None
    assert_no_leftovers({first, second})
    with pytest.raises(ConfigError, match="call reset"):
        await env.step("true")


async def test_reset_options(provider: LocalProvider, tmp_path: Path) -> None:
    env = AsyncSandboxEnv(provider=provider)
    with pytest.raises(ConfigError, match="no task to run"):
        await env.reset()
    with pytest.raises(ConfigError, match="unknown reset option"):
        await env.reset(options={"tsk": answer_task()})
    obs, info = await env.reset(options={"task": {"id": "d", "instruction": "from a dict"}})
    assert obs == "from a dict" and info["task_id"] == "d"
    obs, _ = await env.reset()  # the last task given is kept
    assert obs == "from a dict"
    await env.close()

    rows = [answer_task(id=f"t{i}", instruction=f"task {i}") for i in range(5)]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(t.model_dump_json() for t in rows))
    env = AsyncSandboxEnv(tasks=path, provider=provider)
    obs, info = await env.reset(options={"task_id": "t3"})
    assert (obs, info["task_id"]) == ("task 3", "t3")
    firsts = []
    for _ in range(2):
        await env.reset(seed=7)
        firsts.append([(await env.reset())[1]["task_id"] for _ in range(4)])
    assert firsts[0] == firsts[1]
    with pytest.raises(ConfigError, match="no task with id 'nope'; known: 't0'"):
        await env.reset(options={"task_id": "nope"})
    await env.close()


async def test_bad_env_arguments() -> None:
    with pytest.raises(ConfigError, match="max_output_chars"):
        AsyncSandboxEnv(answer_task(), max_output_chars=10)
    with pytest.raises(ConfigError, match="not str"):
        AsyncSandboxEnv("not a task")  # type: ignore[arg-type]


async def test_dir_task_runs_end_to_end(provider: LocalProvider, tmp_path: Path) -> None:
    root = tmp_path / "greet"
    (root / "files").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "task.toml").write_text('max_turns = 5\n[verifier]\ncommand = "sh test_greet.sh"\n')
    (root / "instruction.md").write_text("Make ./greet.sh print hello.")
    (root / "files" / "greet.sh").write_text("#!/bin/sh\necho bye\n")
    (root / "files" / "greet.sh").chmod(0o755)
    (root / "tests" / "test_greet.sh").write_text('test "$(/work/greet.sh)" = hello\n')
    async with AsyncSandboxEnv(Task.from_dir(root), provider=provider) as env:
        obs, _ = await env.reset()
        assert obs == "Make ./greet.sh print hello."
        assert "bye" in (await env.step("./greet.sh"))[0]
        await env.step("sed -i s/bye/hello/ greet.sh")
        assert (await env.step({"tool": "submit"}))[1] == 1.0


def test_charset_is_wide_and_printable() -> None:
    chars = charset()
    assert set(string.printable) - set("\r\x0b\x0c") <= chars
    assert {"é", "中", "→", "\ufffd"} <= chars
    assert not {"\x00", "\x1b", "\r"} & chars
