"""Scoring the final state of an episode: stop the agent, then run the task's verifier."""

from __future__ import annotations

import inspect
import posixpath
import secrets

from rollbox.envs.task import Task, TestsVerifier
from rollbox.errors import CommandError, SandboxFileError
from rollbox.rewards import RewardResult
from rollbox.sandbox.base import AsyncSandbox

_DETAIL_CHARS = 2000


async def stop_agent_processes(sandbox: AsyncSandbox) -> str | None:
    """Kill every process in the sandbox but its init; a description of the failure, or None.

    It fails only when the sandbox's own processes survive SIGKILL (which the agent cannot
    cause): the episode then scores 0.
    """
    try:
        await sandbox.commands.kill_all()
    except CommandError as exc:
        return f"could not stop the agent's processes: {exc}"
    return None


async def verify(sandbox: AsyncSandbox, task: Task) -> RewardResult:
    """Score the sandbox with the task's verifier, after stopping every agent process.

    A failure caused by the sandbox's state (tests that fail, a full /tmp, a pids limit held by
    the agent) scores 0.0 with the reason in ``details``; an infrastructure failure (the sandbox
    died) or a bug in a verifier callable raises.
    """
    verifier = task.verifier
    if verifier is None:
        return RewardResult(score=0.0, details={"verifier": "none"})
    problem = await stop_agent_processes(sandbox)
    if problem is not None:
        return RewardResult(score=0.0, details={"error": problem})
    if isinstance(verifier, TestsVerifier):
        return await run_tests(sandbox, verifier)
    name = getattr(verifier, "__name__", type(verifier).__name__)
    value = verifier(sandbox, task)
    if inspect.isawaitable(value):
        value = await value
    return RewardResult.coerce(value, name=name)


async def run_tests(sandbox: AsyncSandbox, verifier: TestsVerifier) -> RewardResult:
    """Upload the hidden files to a fresh directory and run the test command there."""
    directory = f"/tmp/.rollbox-verifier-{secrets.token_hex(8)}"
    try:
        if verifier.files:
            for relative, file in verifier.files.items():
                path = posixpath.join(directory, relative)
                await sandbox.files.write(path, file.content, mode=file.mode)
        else:
            made = await sandbox.commands.run(f"mkdir -p -- {directory}", cwd="/")
            if not made.ok:
                raise SandboxFileError(f"mkdir {directory}: {made.stderr.strip()}")
    except SandboxFileError as exc:  # e.g. the agent filled or locked /tmp
        return _failed(f"could not upload the hidden tests: {exc}")
    nonce = secrets.token_hex(16) if verifier.stdin_nonce else None
    try:
        result = await sandbox.commands.run(
            verifier.command,
            cwd=verifier.cwd or directory,
            # A HOME of the verifier's own: the agent's (/work) may hold a planted
            # ~/.local/.../usercustomize.py, .bashrc or pip config that would run in the tests.
            env={
                "TESTS_DIR": directory,
                "HOME": directory,
                "PYTHONNOUSERSITE": "1",
                **verifier.env,
            },
            timeout_seconds=verifier.timeout_seconds,
            stdin=f"{nonce}\n" if nonce else None,
        )
    except CommandError as exc:
        return _failed(f"the test command could not start: {exc}")
    passed = result.exit_code == 0 and not result.timed_out
    if nonce is not None:
        confirmed = nonce in result.stdout.split()
        passed = passed and confirmed
    stdout, stderr = result.stdout, result.stderr
    if nonce is not None:
        stdout = stdout.replace(nonce, "<nonce>")
    details = {
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "duration_s": result.duration_s,
        "stdout": stdout[-_DETAIL_CHARS:],
        "stderr": stderr[-_DETAIL_CHARS:],
    }
    if nonce is not None:
        details["nonce_confirmed"] = confirmed
    score = 1.0 if passed else 0.0
    return RewardResult(score=score, components={"tests": score}, details=details)


def _failed(reason: str) -> RewardResult:
    return RewardResult(score=0.0, components={"tests": 0.0}, details={"error": reason})
