"""100 OpenEnv WebSocket sessions at once, each with its own sandbox; none outlives its client."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import assert_no_leftovers
from tests.server.conftest import ServerProcess, running_server

openenv_core = pytest.importorskip("openenv.core", reason="pip install openenv")

SESSIONS = 100
IN_PROCESS = 60  # the rest run in a client process that is killed with SIGKILL
TASK: dict[str, Any] = {
    "id": "echo",
    "instruction": "Write your number to /work/answer.txt, then submit.",
    "verifier": {
        "command": 'test -s /work/answer.txt && sh "$TESTS_DIR/check.sh"',
        "files": {"check.sh": "grep -qx '[0-9]*' /work/answer.txt\n"},
    },
    "max_turns": 5,
}

# Opens its sessions, starts a background process in each, prints their sandbox ids, then
# waits to be killed: a trainer that crashes mid-episode.
_VANISHING = """
import asyncio, json, sys
from openenv.core import GenericEnvClient

async def session(url, task):
    env = GenericEnvClient(base_url=url, connect_timeout_s=60, message_timeout_s=120)
    await env.connect()
    result = await env.reset(task=task)
    await env.step({"tool": "bash", "command": "sleep 1000 & echo started"})
    return env, result.metadata["sandbox_id"]

async def main():
    url, count, task = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    opened = await asyncio.gather(*(session(url, task) for _ in range(count)))
    print(json.dumps([sandbox_id for _, sandbox_id in opened]), flush=True)
    await asyncio.sleep(1000)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def big_server() -> Iterator[ServerProcess]:
    with running_server("--max-sessions", "128", "--max-sandboxes", "128") as server:
        yield server


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_100_websocket_sessions_and_nothing_left(big_server: ServerProcess) -> None:
    vanishing = subprocess.Popen(
        [sys.executable, "-c", _VANISHING, big_server.url, str(SESSIONS - IN_PROCESS), json.dumps(TASK)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    clients: list[Any] = []
    ids: set[str] = set()
    try:

        async def open_session(number: int) -> Any:
            env = openenv_core.GenericEnvClient(
                base_url=big_server.url, connect_timeout_s=60, message_timeout_s=120
            )
            clients.append(env)
            await env.connect()
            result = await env.reset(task=TASK)
            ids.add(result.metadata["sandbox_id"])
            step = await env.step({"tool": "bash", "command": f"echo {number} > answer.txt"})
            assert step.metadata["exit_code"] == 0
            return env

        envs = await asyncio.gather(*(open_session(n) for n in range(IN_PROCESS)))
        assert vanishing.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(vanishing.stdout.readline), 90)
        assert line, vanishing.stderr.read() if vanishing.stderr else "the client process died"
        ids.update(json.loads(line))

        # all 100 live at once, each in a sandbox of its own
        assert len(ids) == SESSIONS
        stats = await asyncio.to_thread(big_server.stats)
        assert (stats["sessions"], stats["sandboxes"]) == (SESSIONS, SESSIONS), stats

        # half of the in-process clients finish their episode, the other half just leave
        async def finish(env: Any) -> float:
            result = await env.step({"tool": "submit"})
            assert result.done
            await env.close()
            return float(result.reward)

        rewards = await asyncio.gather(*(finish(env) for env in envs[: IN_PROCESS // 2]))
        assert rewards == [1.0] * (IN_PROCESS // 2)
        await asyncio.gather(*(env.close() for env in envs[IN_PROCESS // 2 :]))
    finally:
        vanishing.send_signal(signal.SIGKILL)  # the rest vanish without a word
        vanishing.wait()
        for stream in (vanishing.stdout, vanishing.stderr):
            if stream is not None:
                stream.close()
        for env in clients:
            await env.close()

    stats = await asyncio.to_thread(big_server.wait_until_idle, 30)
    assert (stats["sessions"], stats["sandboxes"]) == (0, 0), stats
    assert_no_leftovers(ids)
