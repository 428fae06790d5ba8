"""A small real dataset and agents for the runner tests (also loaded by ``rollbox run``).

Each instance asks for a number in /work/answer.txt; the expected number stays on the host and
is compared there. An agent's behaviour is chosen per instance by its ``mode``.
``ROLLBOX_TEST_LOG``, if set, names a file where each agent call appends
``<instance id> <sandbox id>`` (to check resume and leaks from another process).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from rollbox.runner import AgentResult
from rollbox.sandbox import AsyncSandbox, Limits, SandboxSpec


def _log(instance: dict[str, Any], sandbox: AsyncSandbox) -> None:
    path = os.environ.get("ROLLBOX_TEST_LOG")
    if path:
        with open(path, "a") as handle:
            handle.write(f"{instance['id']} {sandbox.id}\n")
            handle.flush()


class AnswerDataset:
    """Instances ``{"id", "expected", "mode"}``; the sandbox gets only the question."""

    def __init__(self, instances: list[dict[str, Any]]) -> None:
        self._instances = instances
        self.setups: list[str] = []

    def instances(self) -> list[dict[str, Any]]:
        return self._instances

    def template(self, instance: dict[str, Any]) -> SandboxSpec:
        return SandboxSpec(
            template="python", limits=Limits(memory_mb=256, pids=64), ttl_seconds=120
        )

    async def setup(self, sandbox: AsyncSandbox, instance: dict[str, Any]) -> bool:
        self.setups.append(sandbox.id)
        if instance.get("mode") == "skip":
            return False
        if instance.get("mode") == "setup-raises":
            raise RuntimeError("the dataset could not prepare this instance")
        await sandbox.files.write("/work/question.txt", f"{instance['id']}\n")
        return True

    async def score(self, sandbox: AsyncSandbox, instance: dict[str, Any], patch: str) -> dict:
        if instance.get("mode") == "score-raises":
            raise ValueError("the scorer is broken")
        if instance.get("mode") == "tamper":
            await asyncio.sleep(1.0)  # a tamperer left running would have struck by now
        leftovers = await sandbox.files.exists("/work/agent-was-here")
        try:
            answer = (await sandbox.files.read_text("/work/answer.txt")).strip()
        except Exception:
            answer = ""
        # compared on the host: the expected answer never enters a sandbox
        score = 1.0 if answer == instance["expected"] else 0.0
        return {"score": score, "answer": answer, "agent_files_seen": leftovers}


class ScriptedAgent:
    """Behaves as each instance's ``mode`` says; counts how many solve at once."""

    def __init__(self) -> None:
        self.running = 0
        self.most_at_once = 0
        self.calls: list[str] = []

    async def solve(
        self, sandbox: AsyncSandbox, instance: dict[str, Any], *, model: str | None
    ) -> AgentResult:
        _log(instance, sandbox)
        self.calls.append(instance["id"])
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            mode = instance.get("mode", "right")
            await sandbox.files.write("/work/agent-was-here", "x")
            if mode == "slow":
                await asyncio.sleep(float(instance.get("seconds", 1.0)))
            if mode == "hangs":
                await sandbox.commands.run("sleep 1000", timeout_seconds=None)
            if mode == "raises":
                raise RuntimeError("the model API is down")
            if mode == "tamper":
                # a process that would overwrite the answer after the agent is done
                await sandbox.commands.spawn(
                    "sleep 0.5; echo wrong > /work/answer.txt", timeout_seconds=None
                )
            answer = instance["expected"] if mode != "wrong" else "-1"
            if model == "always-wrong":
                answer = "-1"
            await sandbox.files.write("/work/answer.txt", answer + "\n")
            return AgentResult(patch=answer, files={"/work/answer.txt": answer + "\n"})
        finally:
            self.running -= 1


def _instances() -> list[dict[str, Any]]:
    count = int(os.environ.get("ROLLBOX_TEST_N", "6"))
    seconds = float(os.environ.get("ROLLBOX_TEST_SECONDS", "0"))
    mode = "slow" if seconds else "right"
    return [
        {"id": f"q{i}", "expected": str(i * 7), "mode": mode, "seconds": seconds}
        for i in range(count)
    ]


dataset = AnswerDataset(_instances())
agent = ScriptedAgent()
