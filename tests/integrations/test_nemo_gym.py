"""The NeMo Gym integration, driven with the real nemo-gym package over loopback HTTP.

The server and the clients run in NeMo Gym's Python (3.13, see ``_nemo_gym_helpers``): clients
call the server as NeMo Gym's simple agent and Environment Server do (seed, tool calls, verify,
close); one test runs NeMo Gym's SimpleAgent ``/run`` itself with a scripted policy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollbox.envs import Task
from tests.integrations._nemo_gym_helpers import (
    Server,
    answer_task,
    drive,
    example_rows,
    nemo_gym_python,
    row_for,
    start_server,
    wait_until_gone,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

IDLE_SECONDS = 2.0


@pytest.fixture(scope="module")
def python() -> str:
    return nemo_gym_python()


@pytest.fixture(scope="module")
def server(python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module, with a short idle timeout; its sandboxes are checked at the
    end: a graceful stop (SIGTERM) kills every one of them without any reaper."""
    directory = tmp_path_factory.mktemp("nemo-gym")
    config = write_config(directory, session_idle_timeout_seconds=IDLE_SECONDS)
    running = start_server(python, config, directory / "server.log")
    try:
        yield running
    finally:
        left_before = running.sandbox_ids()
        code = running.stop(signal.SIGTERM)
        # uvicorn shuts down cleanly, then re-raises the signal it caught
        assert code in (0, -signal.SIGTERM), running.log_text()
        assert "Application shutdown complete" in running.log_text()
        wait_until_gone(left_before, timeout=10)
        assert not running.sandbox_ids()


def clients(python: str, server: Server, *scripts: list[dict[str, Any]]) -> list[list[dict]]:
    """Run each script as its own client (own cookie jar), all at once; their results."""
    return drive(python, "clients", {"base_url": server.url, "clients": list(scripts)})["clients"]


def call(tool: str, **args: Any) -> dict[str, Any]:
    return {"op": "call", "tool": tool, "args": args}


def by_op(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        grouped.setdefault(result["op"], []).append(result)
    return grouped


# -- one episode ---------------------------------------------------------------------------------


def test_an_episode_seeds_calls_tools_verifies_and_closes(python: str, server: Server) -> None:
    row = row_for(answer_task())
    (results,) = clients(
        python,
        server,
        [
            {"op": "seed", "row": row},
            call("run_command", command="echo 42 > answer.txt && cat answer.txt"),
            call("read_file", path="answer.txt"),
            call("write_file", path="notes/plan.txt", content="done\n"),
            call("run_command", command="cat /work/notes/plan.txt; exit 3"),
            {"op": "verify", "row": row},
            {"op": "verify", "row": row},
            call("run_command", command="echo after verify"),
            {"op": "close"},
            {"op": "close"},
            call("run_command", command="echo after close"),
        ],
    )
    seed, run1, read, write, run2, verify1, verify2, late, close1, close2, closed = results
    assert seed["status"] == 200, seed
    assert seed["body"]["task_id"] == "answer"
    sandbox_id = seed["body"]["sandbox_id"]
    assert run1["status"] == 200
    assert run1["body"]["exit_code"] == 0
    assert "42" in run1["body"]["output"]
    assert read["body"]["output"].strip() == "42"
    assert "wrote 5 bytes to /work/notes/plan.txt" in write["body"]["output"]
    assert run2["body"]["exit_code"] == 3  # a failing command is a result, shown to the model
    assert "done" in run2["body"]["output"]

    assert verify1["status"] == 200, verify1
    assert verify1["body"]["reward"] == 1.0
    assert verify1["body"]["reward_components"] == {"tests": 1.0}
    assert verify1["body"]["termination"] == "submit"
    assert verify1["body"]["turns"] == 4
    assert verify1["body"]["verifier_details"]["exit_code"] == 0
    assert verify1["body"]["response"]["object"] == "response"  # the request is echoed
    assert verify2["body"]["reward"] == verify1["body"]["reward"]

    assert late["status"] == 409 and "episode is over" in late["body"]["detail"]
    assert close1["status"] == 200 and close2["status"] == 200
    assert closed["status"] == 410
    assert closed["body"]["detail"]["failure_kind"] == "session_lost"
    wait_until_gone({sandbox_id})


def test_a_wrong_answer_scores_zero_with_its_components(python: str, server: Server) -> None:
    row = row_for(answer_task())
    (results,) = clients(
        python,
        server,
        [
            {"op": "seed", "row": row},
            call("run_command", command="echo 41 > answer.txt"),
            {"op": "verify", "row": row},
            {"op": "close"},
        ],
    )
    verify = results[2]
    assert verify["status"] == 200
    assert verify["body"]["reward"] == 0.0
    assert verify["body"]["reward_components"] == {"tests": 0.0}
    wait_until_gone({results[0]["body"]["sandbox_id"]})


def test_the_episode_ends_at_max_turns_and_verify_returns_that_score(
    python: str, server: Server
) -> None:
    row = row_for(answer_task(max_turns=2))
    (results,) = clients(
        python,
        server,
        [
            {"op": "seed", "row": row},
            call("run_command", command="echo 42 > answer.txt"),
            call("run_command", command="true"),
            call("run_command", command="echo 0 > answer.txt"),
            {"op": "verify", "row": row},
            {"op": "close"},
        ],
    )
    _, first, last, refused, verify, _ = results
    assert first["body"]["done"] is False
    assert last["body"]["done"] is True
    assert "max_turns reached" in last["body"]["output"]
    assert refused["status"] == 409  # the third command never ran: the answer stays 42
    assert verify["body"]["reward"] == 1.0
    assert verify["body"]["termination"] == "max_turns"


# -- session lifecycle -----------------------------------------------------------------------------


def test_seed_is_idempotent_and_a_closed_session_stays_closed(python: str, server: Server) -> None:
    row = row_for(answer_task())
    other = row_for(answer_task("other", expected="7"))
    results, never_seeded = clients(
        python,
        server,
        [
            {"op": "seed", "row": row},
            call("run_command", command="echo 42 > answer.txt"),
            {"op": "seed", "row": row},
            call("read_file", path="answer.txt"),
            {"op": "seed", "row": other},
            {"op": "close"},
            {"op": "seed", "row": row},
        ],
        [{"op": "close"}, {"op": "close"}],
    )
    seed1, _, seed2, read, seed_other, close, late_seed = results
    assert seed1["status"] == seed2["status"] == 200
    assert seed2["body"]["sandbox_id"] == seed1["body"]["sandbox_id"]  # the same session
    assert read["body"]["output"].strip() == "42"  # its state survived the repeated seed
    assert seed_other["status"] == 409  # one session, one task
    assert close["status"] == 200
    assert late_seed["status"] == 409 and "closed" in late_seed["body"]["detail"]
    assert [r["status"] for r in never_seeded] == [200, 200]
    wait_until_gone({seed1["body"]["sandbox_id"]})


def test_typed_sessions_of_an_environment_server(python: str, server: Server) -> None:
    row = row_for(answer_task())
    session = {"session": "resources-session-typed-1", "rollout": "rollout-typed-1"}
    never = {"session": "resources-session-never-seeded", "rollout": "rollout-typed-1"}
    before = server.sandbox_ids()
    (results,) = clients(
        python,
        server,
        [
            {"op": "seed_typed", "row": row, **session},
            {"op": "seed_typed", "row": row, **session},
            call("run_command", command="echo 42 > answer.txt"),
            {"op": "verify", "row": row},
            {"op": "close_typed", **session},
            {"op": "close_typed", **session},
            {"op": "seed_typed", "row": row, **session},
            {"op": "close_typed", **never},
            {"op": "seed_typed", "row": row, **never},
        ],
    )
    statuses = [result["status"] for result in results]
    assert statuses == [200, 200, 200, 200, 200, 200, 409, 200, 409], results
    assert results[0]["body"]["resources_session_id"] == session["session"]
    assert results[3]["body"]["reward"] == 1.0
    assert results[4]["body"] == {"resources_session_id": session["session"]}
    wait_until_gone(server.sandbox_ids() - before)


def test_nemo_gyms_session_contract_check_passes(python: str) -> None:
    result = drive(python, "conformance", {"row": example_rows()[0]})
    assert result == {"passed": True, "sessions_left": 0}


def test_an_idle_session_expires_and_its_sandbox_is_killed(python: str, server: Server) -> None:
    row = row_for(answer_task(step_timeout_seconds=20))
    long_command = f"sleep {IDLE_SECONDS * 2:g} && echo 42 > answer.txt"
    busy, idle = clients(
        python,
        server,
        [
            {"op": "seed", "row": row},
            call("run_command", command=long_command),  # busy longer than the idle timeout
            {"op": "verify", "row": row},
            {"op": "close"},
        ],
        [
            {"op": "seed", "row": row},
            {"op": "sleep", "seconds": IDLE_SECONDS * 3},
            call("run_command", command="echo too late"),
            {"op": "verify", "row": row},
        ],
    )
    assert busy[1]["body"]["exit_code"] == 0
    assert busy[2]["body"]["reward"] == 1.0
    assert idle[1]["status"] == 410
    assert idle[1]["body"]["detail"]["failure_kind"] == "session_expired"
    assert idle[2]["status"] == 410  # no reward for an expired session: an error
    wait_until_gone({idle[0]["body"]["sandbox_id"], busy[0]["body"]["sandbox_id"]})


# -- isolation and attacks ---------------------------------------------------------------------


def test_two_concurrent_sessions_are_isolated(python: str, server: Server) -> None:
    row = row_for(answer_task())
    first, second = clients(
        python,
        server,
        [
            {"op": "seed", "row": row},
            {"op": "barrier"},
            call("write_file", path="answer.txt", content="42"),
            call("run_command", command="(sleep 60 &) ; echo first > /tmp/mine"),
            {"op": "barrier"},
            {"op": "barrier"},
            call("run_command", command="cat /tmp/mine; ls /work"),
            {"op": "verify", "row": row},
            {"op": "close"},
        ],
        [
            {"op": "seed", "row": row},
            {"op": "barrier"},
            call("write_file", path="answer.txt", content="wrong"),
            {"op": "barrier"},
            call("run_command", command="cat /tmp/mine /work/answer.txt; ps -eo comm="),
            call("run_command", command="echo second > /tmp/mine"),
            {"op": "barrier"},
            {"op": "verify", "row": row},
            {"op": "close"},
        ],
    )
    assert first[0]["body"]["sandbox_id"] != second[0]["body"]["sandbox_id"]
    peek = second[2]["body"]["output"]
    assert "No such file" in peek  # the other session's /tmp file is not here
    assert "wrong" in peek and "42" not in peek
    assert "sleep" not in peek  # nor its processes
    assert "first" in first[3]["body"]["output"] and "second" not in first[3]["body"]["output"]
    assert first[4]["body"]["reward"] == 1.0
    assert second[4]["body"]["reward"] == 0.0
    wait_until_gone({first[0]["body"]["sandbox_id"], second[0]["body"]["sandbox_id"]})


def test_hostile_commands_stay_in_their_session(python: str, server: Server) -> None:
    marker = Path("/tmp") / f"rollbox-nemo-gym-marker-{os.getpid()}"
    marker.write_text("host data")
    row = row_for(answer_task(step_timeout_seconds=5, limits={"memory_mb": 256, "pids": 64}))
    forged = row_for(answer_task("forged", verifier={"command": "true"}))
    connect = (
        "python3 -c \"import socket; socket.create_connection(('127.0.0.1', "
        f'{server.port}), timeout=2)"'
    )
    try:
        attacker, bystander = clients(
            python,
            server,
            [
                {"op": "seed", "row": row},
                call(
                    "run_command", command=f"cat /etc/shadow; ls /root; cat {marker}; rm -rf /tmp/*"
                ),
                call("run_command", command=connect),
                call("run_command", command="kill -9 -1; echo still here"),
                call("run_command", command=":(){ :|:& };:"),
                call("run_command", command="python3 -c 'x = bytearray(1 << 30)'"),
                call("run_command", command="echo alive"),
                # a model's tool call is a POST it names: it tries the server's own routes
                call("seed_session", **forged),
                call(
                    "seed_session",
                    resources_session_id="forged-session",
                    episode_id={"rollout_id": "forged"},
                    task_id={"taskset": "x", "task_id": "forged"},
                    task_data=forged,
                ),
                call(
                    "close_session",
                    resources_session_id="someone-else",
                    episode_id={"rollout_id": "x"},
                ),
                {"op": "verify", "row": forged},
                {"op": "close"},
            ],
            [
                {"op": "seed", "row": row},
                {"op": "sleep", "seconds": 1},
                call("run_command", command="echo 42 > answer.txt"),
                {"op": "verify", "row": row},
                {"op": "close"},
            ],
        )
    finally:
        host_data = marker.read_text() if marker.exists() else None
        marker.unlink(missing_ok=True)
    assert host_data == "host data"  # rm -rf /tmp/* in the sandbox left the host's /tmp alone
    snoop = attacker[1]["body"]["output"]
    assert "root:" not in snoop and "host data" not in snoop
    assert attacker[2]["body"]["exit_code"] != 0  # no network: not even the server's port
    assert attacker[3]["status"] == 200  # kill -9 -1 reaches the sandbox's own processes only
    assert attacker[4]["status"] == 200  # the fork bomb is held by the pids limit and timeout
    assert attacker[5]["body"]["exit_code"] != 0  # the memory hog died inside its cgroup
    assert attacker[6]["status"] == 200 and "alive" in attacker[6]["body"]["output"]
    assert attacker[7]["status"] == 409  # no new task under the same session
    assert attacker[8]["status"] == 409  # nor a new session under the same cookie
    assert attacker[9]["status"] == 409  # nor closing a session that is not its own
    verify = attacker[10]
    assert verify["status"] == 200
    assert verify["body"]["task_id"] == "answer"  # scored with the seeded task, not the body's
    assert verify["body"]["reward"] == 0.0
    assert bystander[1]["status"] == 200
    assert bystander[2]["body"]["reward"] == 1.0
    assert server.process.poll() is None
    wait_until_gone({attacker[0]["body"]["sandbox_id"], bystander[0]["body"]["sandbox_id"]})


# -- failures ------------------------------------------------------------------------------------


def test_a_bad_task_is_a_clear_error(python: str, server: Server) -> None:
    no_instruction = answer_task()
    del no_instruction["instruction"]
    broken_setup = answer_task(setup=["exit 7"])
    results = clients(
        python,
        server,
        [{"op": "seed", "row": {**row_for(answer_task()), "task": no_instruction}}],
        [{"op": "seed", "row": row_for(broken_setup)}],
        [{"op": "seed", "row": {**row_for(answer_task()), "task": "not a task"}}],
        [call("run_command", command="echo never seeded")],
    )
    missing, setup, no_task, unseeded = (r[0] for r in results)
    assert missing["status"] == 422 and "instruction" in json.dumps(missing["body"])
    assert setup["status"] == 422 and "exited with 7" in setup["body"]["detail"]
    assert no_task["status"] == 422
    assert unseeded["status"] == 404 and "seed_session" in unseeded["body"]["detail"]


def test_a_sandbox_that_dies_is_an_error_not_a_zero(python: str, server: Server) -> None:
    row = row_for(answer_task())
    (results,) = clients(
        python,
        server,
        [
            {"op": "seed", "row": row},
            call("run_command", command="echo 42 > answer.txt"),
            {"op": "kill_sandbox"},  # from the host, as an OOM killer or a crash would
            call("run_command", command="echo after"),
            {"op": "verify", "row": row},
            {"op": "verify", "row": row},
            {"op": "close"},
        ],
    )
    seed, _, after, verify1, verify2, close = results
    assert after["status"] == 503
    assert after["body"]["detail"]["failure_kind"] == "session_lost"
    for verify in (verify1, verify2):  # no reward at all: the rollout failed, it did not score 0
        assert verify["status"] == 503, verify
        assert verify["body"]["detail"]["failure_kind"] == "session_lost"
    assert close["status"] == 200
    wait_until_gone({seed["body"]["sandbox_id"]})


# -- NeMo Gym's simple agent, the example, the sandbox provider ----------------------------------

SOLUTIONS: dict[str, list[dict[str, Any]]] = {
    "answer-42": [{"tool": "run_command", "args": {"command": "printf 42 > /work/answer.txt"}}],
    "fix-add": [
        {"tool": "read_file", "args": {"path": "calc.py"}},
        {
            "tool": "write_file",
            "args": {"path": "calc.py", "content": "def add(a, b):\n    return a + b\n"},
        },
        {
            "tool": "run_command",
            "args": {"command": "python3 -c 'import calc; print(calc.add(2, 3))'"},
        },
    ],
    "count-lines": [{"tool": "run_command", "args": {"command": "wc -l < data.txt > count.txt"}}],
    "fizzbuzz": [
        {
            "tool": "write_file",
            "args": {
                "path": "fizzbuzz.py",
                "content": "for i in range(1, 16):\n"
                "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 "
                "else 'Buzz' if i % 5 == 0 else i)\n",
            },
        }
    ],
}


def test_nemo_gyms_simple_agent_solves_the_example_tasks(python: str, server: Server) -> None:
    """NeMo Gym's SimpleAgent /run on every example row at once; a scripted policy plays a
    correct solution, so each episode must score 1.0 through the task's hidden tests."""
    rows = example_rows()
    assert {row["task_id"] for row in rows} == set(SOLUTIONS)
    before = server.sandbox_ids()
    spec = {
        "resources_port": server.port,
        "episodes": [{"row": row, "script": SOLUTIONS[row["task_id"]]} for row in rows],
    }
    episodes = drive(python, "agent", spec)["episodes"]
    for row, episode in zip(rows, episodes, strict=True):
        run = episode["run"]
        assert run["status"] == 200, run
        assert run["body"]["task_id"] == row["task_id"]
        assert run["body"]["reward"] == 1.0, run["body"]["verifier_details"]
        assert run["body"]["reward_components"] == {"tests": 1.0}
        assert run["body"]["turns"] == len(SOLUTIONS[row["task_id"]])
        assert episode["model_calls"] == len(SOLUTIONS[row["task_id"]]) + 1
    fix_add = episodes[[r["task_id"] for r in rows].index("fix-add")]
    outputs = [json.loads(output) for output in fix_add["tool_outputs"]]
    assert "return a - b" in outputs[0]["output"]  # the model saw the file it was to fix
    assert outputs[2]["exit_code"] == 0 and outputs[2]["output"].endswith("5")
    # verify ended every episode: their sandboxes are gone although /run never closes sessions
    wait_until_gone(server.sandbox_ids() - before)


def test_the_example_dataset_is_what_the_dataset_command_writes(
    python: str, tmp_path: Path
) -> None:
    rows = example_rows()
    for row in rows:
        task = Task(**row["task"])
        assert task.id == row["task_id"]
        assert row["responses_create_params"]["input"][-1]["content"] == task.instruction
        tools = row["responses_create_params"]["tools"]
        assert [tool["name"] for tool in tools] == ["run_command", "write_file", "read_file"]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row["task"]) + "\n" for row in rows))
    system = rows[0]["responses_create_params"]["input"][0]["content"]
    written = tmp_path / "rows.jsonl"
    command = [python, "-m", "rollbox.integrations.nemo_gym", "dataset", str(tasks)]
    subprocess.run(
        [*command, "-o", str(written), "--system-prompt", system],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert [json.loads(line) for line in written.read_text().splitlines()] == rows


def test_rollbox_runs_nemo_gyms_sandbox_api(python: str) -> None:
    """NeMo Gym's AsyncSandbox on the provider it finds by entry point."""
    out = drive(python, "provider", {})
    assert out["listed"] is True
    assert out["status"] == "running"
    assert out["exec"] == ["hi from /work/project\n", "oops\n", 3, None]
    assert out["copy_exit"] == 0 and out["downloaded"] == "UPLOADED\n"
    assert "not a regular file" in out["fifo"]
    assert out["timeout"] == [125, "timeout", False]
    assert out["sleeps_left"] == "0"  # the timeout killed the command's whole process tree
    _, stdout, stderr = out["hostile"]
    assert stdout == "65534\n" and "No such file" in stderr
    assert out["as_root"].startswith("refused")
    assert out["status_after_stop"] == "stopped"
    assert "no GPUs" in out["gpu"]
    wait_until_gone({out["sandbox_id"]})


def test_a_killed_server_leaves_nothing_the_reaper_does_not_remove(
    python: str, tmp_path: Path
) -> None:
    # started as ng_run starts it: the example's app.py, with the resolved config in its env
    server = start_server(python, write_config(tmp_path), tmp_path / "server.log", as_ng_run=True)
    try:
        row = row_for(answer_task())
        results = clients(
            python, server, [{"op": "seed", "row": row}], [{"op": "seed", "row": row}]
        )
        ids = {result[0]["body"]["sandbox_id"] for result in results}
        assert ids == server.sandbox_ids()
        pids_cgroups = [_pids_cgroup(sandbox_id) for sandbox_id in ids]
    finally:
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
    # the sandboxes die with the server (bwrap's --die-with-parent) ...
    deadline = time.monotonic() + 20
    while any(_processes(cgroup) for cgroup in pids_cgroups):
        assert time.monotonic() < deadline, "sandbox processes outlived the killed server"
        time.sleep(0.1)
    # ... and what is left on disk (cgroups, records) is reaped by the next rollbox process
    subprocess.run([sys.executable, "-m", "rollbox", "cleanup"], check=True, timeout=60)
    wait_until_gone(ids, timeout=5)


def test_importing_the_integration_without_nemo_gym_names_the_extra() -> None:
    import importlib.util

    if importlib.util.find_spec("nemo_gym") is not None:
        pytest.skip("nemo-gym is installed in this Python")
    from rollbox.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=r"pip install 'rollbox\[nemo-gym\]'"):
        import rollbox.integrations.nemo_gym  # noqa: F401


def _pids_cgroup(sandbox_id: str) -> Path:
    from rollbox.sandbox import _host

    record = json.loads((_host.state_dir() / "sandboxes" / f"{sandbox_id}.json").read_text())
    return Path(record["cgroups"]["pids"])


def _processes(cgroup: Path) -> list[str]:
    try:
        return (cgroup / "cgroup.procs").read_text().split()
    except OSError:
        return []
