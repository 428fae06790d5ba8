"""Drive rollbox's NeMo Gym integration with NeMo Gym's own code, in NeMo Gym's Python.

The test suite runs on Python 3.11; NeMo Gym needs 3.13. The tests start this script with the
3.13 venv's interpreter: ``python nemo_gym_driver.py COMMAND JSON``. It prints one JSON document.

Commands:
    clients      HTTP clients that call a running resources server as NeMo Gym's simple agent
                 (seed, tool calls, verify, close) or an Environment Server (typed sessions)
                 does, through NeMo Gym's aiohttp ``request`` and with its cookie handling.
    agent        NeMo Gym's real SimpleAgent ``/run`` against a running resources server, with a
                 scripted policy model served on loopback in place of an LLM.
    conformance  NeMo Gym's resources-session contract check, on the app in this process.
    provider     NeMo Gym's ``AsyncSandbox`` on the ``rollbox`` provider found by entry point.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import (
    ResourcesCloseSessionRequest,
    ResourcesSeedSessionRequest,
)
from nemo_gym.episode_types import EpisodeId, TaskId
from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.server_utils import (
    GlobalAIOHTTPAsyncClientConfig,
    request,
    set_global_aiohttp_client,
)
from responses_api_agents.simple_agent.app import (
    SimpleAgentRunRequest,
    _cookies,  # how the simple agent reads a response's cookies
)


def empty_response(**fields: Any) -> dict[str, Any]:
    """A Responses API result as a verify body carries it."""
    values: dict[str, Any] = {
        "id": "resp-driver",
        "created_at": 0,
        "model": "scripted",
        "object": "response",
        "output": [],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
    }
    values.update(fields)
    return NeMoGymResponse.model_validate(values).model_dump(mode="json")


async def _answer(response: Any) -> dict[str, Any]:
    text = (await response.content.read()).decode()
    try:
        body: Any = json.loads(text)
    except json.JSONDecodeError:
        body = text
    return {"status": response.status, "body": body}


async def run_client(base_url: str, ops: list[dict[str, Any]], barrier: asyncio.Barrier) -> list:
    """One rollout's calls, in order, with the cookie jar the simple agent keeps."""
    cookies: dict[str, str] = {}
    sandbox_id = None
    results = []
    for op in ops:
        kind = op["op"]
        if kind == "sleep":
            await asyncio.sleep(op["seconds"])
            continue
        if kind == "barrier":
            await barrier.wait()
            continue
        if kind == "kill_sandbox":  # SIGKILL the session's sandbox from the host
            kill_sandbox(sandbox_id)
            continue
        if kind == "seed":  # an agent's /run: the whole row, the cookie names the session
            body = SimpleAgentRunRequest.model_validate(op["row"]).model_dump()
            response = await request("POST", f"{base_url}/seed_session", json=body, cookies=cookies)
            cookies = _cookies(response)
        elif kind == "seed_typed":  # an Environment Server: a caller-assigned session id
            body = ResourcesSeedSessionRequest(
                resources_session_id=op["session"],
                episode_id=EpisodeId(rollout_id=op["rollout"]),
                task_id=TaskId(taskset="rollbox", task_id=op["row"]["task_id"]),
                task_data=op["row"],
            ).model_dump(mode="json")
            response = await request("POST", f"{base_url}/seed_session", json=body, cookies=cookies)
            cookies = _cookies(response) or cookies
        elif kind == "call":  # a model's tool call: POST /<tool name> with its arguments
            response = await request(
                "POST", f"{base_url}/{op['tool']}", json=op["args"], cookies=cookies
            )
            cookies.update(_cookies(response))
        elif kind == "verify":
            body = op["row"] | {"response": empty_response()}
            response = await request("POST", f"{base_url}/verify", json=body, cookies=cookies)
        elif kind == "close":
            response = await request("POST", f"{base_url}/close_session", json={}, cookies=cookies)
        elif kind == "close_typed":
            body = ResourcesCloseSessionRequest(
                resources_session_id=op["session"], episode_id=EpisodeId(rollout_id=op["rollout"])
            ).model_dump(mode="json")
            response = await request(
                "POST", f"{base_url}/close_session", json=body, cookies=cookies
            )
        else:
            raise ValueError(f"unknown op {kind!r}")
        answer = await _answer(response)
        if kind == "seed" and isinstance(answer["body"], dict):
            sandbox_id = answer["body"].get("sandbox_id", sandbox_id)
        results.append({"op": kind, **answer})
    return results


def kill_sandbox(sandbox_id: str) -> None:
    from rollbox.sandbox import _host

    record = json.loads((_host.state_dir() / "sandboxes" / f"{sandbox_id}.json").read_text())
    for pid in (Path(record["cgroups"]["pids"]) / "cgroup.procs").read_text().split():
        os.kill(int(pid), signal.SIGKILL)


async def clients(spec: dict[str, Any]) -> dict[str, Any]:
    set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    barrier = asyncio.Barrier(len(spec["clients"]))
    results = await asyncio.gather(
        *(run_client(spec["base_url"], ops, barrier) for ops in spec["clients"])
    )
    return {"clients": results}


# -- the real SimpleAgent, with a scripted policy ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scripted_model_app(scripts: dict[str, list[dict]], seen: dict[str, list]) -> FastAPI:
    """A Responses API model that plays a script per prompt: one tool call per turn, then a
    final message. The script is the one whose key is the episode's user message."""
    app = FastAPI()

    @app.post("/v1/responses")
    async def responses(request: Request) -> dict[str, Any]:
        body = await request.json()
        prompt = next(item["content"] for item in body["input"] if item.get("role") == "user")
        seen.setdefault(prompt, []).append(body)
        script = scripts[prompt]
        turn = sum(1 for item in body["input"] if item.get("type") == "function_call")
        if turn < len(script):
            step = script[turn]
            item = {
                "type": "function_call",
                "call_id": f"call-{turn}",
                "name": step["tool"],
                "arguments": json.dumps(step["args"]),
            }
        else:
            item = {
                "type": "message",
                "id": "msg-final",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Done.", "annotations": []}],
            }
        return empty_response(id=f"resp-{turn}", output=[item])

    return app


async def agent(spec: dict[str, Any]) -> dict[str, Any]:
    import uvicorn
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from omegaconf import OmegaConf
    from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig

    set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    host, resources_port = "127.0.0.1", spec["resources_port"]
    model_port, agent_port = _free_port(), _free_port()
    global_config = OmegaConf.create(
        {
            "head_server": {"host": host, "port": _free_port()},
            "rollbox_shell": {
                "resources_servers": {"rollbox": {"host": host, "port": resources_port}}
            },
            "policy_model": {
                "responses_api_models": {"scripted": {"host": host, "port": model_port}}
            },
            "rollbox_agent": {
                "responses_api_agents": {"simple_agent": {"host": host, "port": agent_port}}
            },
        }
    )
    config = SimpleAgentConfig(
        name="rollbox_agent",
        host=host,
        port=agent_port,
        entrypoint="app.py",
        resources_server={"type": "resources_servers", "name": "rollbox_shell"},
        model_server={"type": "responses_api_models", "name": "policy_model"},
        max_steps=10,
    )
    client = ServerClient(
        head_server_config=BaseServerConfig(host=host, port=global_config.head_server.port),
        global_config_dict=global_config,
    )
    simple_agent = SimpleAgent(config=config, server_client=client)
    seen: dict[str, list[Any]] = {}
    scripts = {_prompt(episode["row"]): episode["script"] for episode in spec["episodes"]}
    servers = [
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        for app, port in (
            (scripted_model_app(scripts, seen), model_port),
            (simple_agent.setup_webserver(), agent_port),
        )
    ]
    tasks = [asyncio.ensure_future(server.serve()) for server in servers]

    async def run(row: dict[str, Any]) -> dict[str, Any]:
        response = await request("POST", f"http://{host}:{agent_port}/run", json=row)
        calls = seen.get(_prompt(row), [])
        outputs = [
            item["output"]
            for item in (calls[-1]["input"] if calls else [])
            if item.get("type") == "function_call_output"
        ]
        return {"run": await _answer(response), "model_calls": len(calls), "tool_outputs": outputs}

    try:
        while not all(server.started for server in servers):
            await asyncio.sleep(0.02)
        # every episode at once, through one agent, as a rollout collection sends them
        results = await asyncio.gather(*(run(episode["row"]) for episode in spec["episodes"]))
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"episodes": results}


def _prompt(row: dict[str, Any]) -> str:
    messages = row["responses_create_params"]["input"]
    return next(message["content"] for message in messages if message["role"] == "user")


# -- NeMo Gym's own checks ----------------------------------------------------------------------


def conformance(spec: dict[str, Any]) -> dict[str, Any]:
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from nemo_gym.testing.session_conformance import check_resources_session_contract
    from omegaconf import OmegaConf

    from rollbox.integrations.nemo_gym import RollboxResourcesServer, RollboxResourcesServerConfig

    server = RollboxResourcesServer(
        config=RollboxResourcesServerConfig(
            name="rollbox_shell", host="127.0.0.1", port=0, entrypoint="app.py"
        ),
        server_client=ServerClient(
            head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
            global_config_dict=OmegaConf.create({}),
        ),
    )
    seed = ResourcesSeedSessionRequest(
        resources_session_id="resources-session-conformance",
        episode_id=EpisodeId(rollout_id="rollout-conformance"),
        task_id=TaskId(taskset="rollbox", task_id=spec["row"]["task_id"]),
        task_data=spec["row"],
    )
    check_resources_session_contract(server.setup_webserver(), seed, keeps_state=True)
    return {"passed": True, "sessions_left": len(server.sessions.live)}


async def provider(spec: dict[str, Any]) -> dict[str, Any]:
    from nemo_gym.sandbox import AsyncSandbox, SandboxSpec, list_providers

    out: dict[str, Any] = {"listed": "rollbox" in list_providers()}
    config = {"rollbox": {"backend": "local", "default_timeout_s": 30}}
    sandbox = AsyncSandbox(config, SandboxSpec(workdir="/work/project", env={"GREETING": "hi"}))
    await sandbox.start()
    try:
        out["sandbox_id"] = sandbox._handle.sandbox_id
        out["status"] = (await sandbox.status()).value
        result = await sandbox.exec("echo $GREETING from $(pwd); echo oops >&2; exit 3")
        out["exec"] = [result.stdout, result.stderr, result.return_code, result.error_type]
        with tempfile.TemporaryDirectory() as scratch:
            source = Path(scratch, "in.txt")
            source.write_text("uploaded\n")
            await sandbox.upload(source, "data/in.txt")
            copied = await sandbox.exec("cat data/in.txt | tr a-z A-Z > out.txt")
            out["copy_exit"] = copied.return_code
            await sandbox.download("/work/project/out.txt", Path(scratch, "got", "out.txt"))
            out["downloaded"] = Path(scratch, "got", "out.txt").read_text()
            await sandbox.exec("mkfifo pipe")
            try:
                await sandbox.download("/work/project/pipe", Path(scratch, "pipe"))
                out["fifo"] = "downloaded"
            except Exception as exc:  # a FIFO must be refused, not hang the caller
                out["fifo"] = f"{type(exc).__name__}: {exc}"
        timed = await sandbox.exec("sleep 30 & sleep 30; echo never", timeout_s=0.5)
        out["timeout"] = [timed.return_code, timed.error_type, "never" in (timed.stdout or "")]
        after = await sandbox.exec("ps -eo comm= | grep -c sleep || true")
        out["sleeps_left"] = (after.stdout or "").strip()
        hostile = await sandbox.exec("cat /etc/shadow; ls /root; id -u", timeout_s=10)
        out["hostile"] = [hostile.return_code, hostile.stdout, hostile.stderr]
        try:
            await sandbox.exec("true", user="root")
            out["as_root"] = "ran"
        except ValueError as exc:
            out["as_root"] = f"refused: {exc}"
    finally:
        await sandbox.stop()
    out["status_after_stop"] = (await sandbox.status()).value
    try:
        await AsyncSandbox(config, SandboxSpec(resources={"gpu": 1})).start()
        out["gpu"] = "started"
    except Exception as exc:
        out["gpu"] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> None:
    command, spec = sys.argv[1], json.loads(sys.argv[2])
    if command == "clients":
        result = asyncio.run(clients(spec))
    elif command == "agent":
        result = asyncio.run(agent(spec))
    elif command == "conformance":
        result = conformance(spec)
    elif command == "provider":
        result = asyncio.run(provider(spec))
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
