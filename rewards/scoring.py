"""Scoring a model's program: a fresh sandbox per sample, many at once under a cap."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollbox.errors import SandboxFileError
from rollbox.rewards.base import INFRASTRUCTURE_ERRORS, Reward, Sample, log
from rollbox.rewards.function_tests import SOLUTION_PATH
from rollbox.rewards.result import RewardResult
from rollbox.sandbox.base import AsyncSandbox, Provider
from rollbox.sandbox.models import Limits

# Enough for a function and its tests; small enough that many run at once.
DEFAULT_LIMITS = Limits(memory_mb=512, pids=128, cpus=1.0, disk_mb=256)


async def score_program(
    program: str,
    reward: Reward,
    *,
    completion: str | None = None,
    row: Mapping[str, Any] | None = None,
    provider: str | Provider = "local",
    template: str = "python",
    limits: Limits | None = None,
    solution_path: str = SOLUTION_PATH,
    ttl_seconds: float = 900.0,
) -> RewardResult:
    """Write ``program`` to ``solution_path`` in a fresh sandbox and score it with ``reward``.

    The sandbox is killed afterwards, whatever happens. ``details["sandbox_id"]`` names it.
    A reward that needs no sandbox (text rewards) is scored without starting one.

    Raises:
        SandboxStartError, SandboxDeadError, TooManySandboxesError: infrastructure failed;
            this is not the program's score.
    """
    sample_row = dict(row or {})
    if not reward.uses_sandbox:
        return await reward.score(Sample(completion=completion, row=sample_row))
    async with await AsyncSandbox.create(
        f"reward-{reward.name}"[:128],
        from_template=template,
        limits=limits or DEFAULT_LIMITS,
        provider=provider,
        ttl_seconds=ttl_seconds,
    ) as sandbox:
        try:
            await sandbox.files.write(solution_path, program)
        except SandboxFileError as exc:  # e.g. a program larger than the disk limit
            result = RewardResult.failure(f"could not write the program: {exc}", reward.name)
        else:
            sample = Sample(sandbox=sandbox, completion=completion, row=sample_row)
            result = await reward.score(sample)
    details = {**result.details, "sandbox_id": sandbox.id}
    return result.model_copy(update={"details": details})


async def score_programs(
    programs: Sequence[str],
    reward: Reward,
    *,
    completions: Sequence[str | None] | None = None,
    rows: Sequence[Mapping[str, Any]] | None = None,
    n_concurrent: int = 8,
    **options: Any,
) -> list[RewardResult | None]:
    """Score many programs, each in its own sandbox, at most ``n_concurrent`` at once.

    Returns one result per program, in order; ``None`` where the infrastructure failed (the
    error is logged), never a silent 0.0. Any other error (a bad reward configuration) is
    raised once the samples already running have finished; the rest are not started.
    """
    count = len(programs)
    completions = list(completions) if completions is not None else [None] * count
    rows = list(rows) if rows is not None else [{}] * count
    if not len(completions) == len(rows) == count:
        raise ValueError("programs, completions and rows must have the same length")
    gate = asyncio.Semaphore(max(1, n_concurrent))
    results: list[RewardResult | None] = [None] * count
    errors: list[Exception] = []

    async def one(index: int) -> None:
        async with gate:
            if errors:  # a bad configuration fails every sample: stop starting sandboxes
                return
            started = time.monotonic()
            try:
                results[index] = await score_program(
                    programs[index],
                    reward,
                    completion=completions[index],
                    row=rows[index],
                    **options,
                )
            except INFRASTRUCTURE_ERRORS as exc:
                log.error(
                    "reward %r: no score for sample %d, the sandbox failed after %.2f s: %s: %s",
                    reward.name,
                    index,
                    time.monotonic() - started,
                    type(exc).__name__,
                    exc,
                )
            except Exception as exc:
                errors.append(exc)

    # The others finish rather than being cancelled mid-start: their sandboxes are killed anyway.
    await asyncio.gather(*(one(index) for index in range(count)))
    if errors:
        raise errors[0]
    return results
