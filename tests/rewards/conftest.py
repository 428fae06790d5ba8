"""Helpers for the reward tests: score a program in a fresh sandbox of the test's provider."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from rollbox.rewards import Reward, RewardResult, score_program

Score = Callable[..., Awaitable[RewardResult]]


@pytest.fixture
def score(provider: Any) -> Score:
    """``await score(program, reward, row=..., completion=...)`` in a fresh sandbox."""

    async def run(program: str, reward: Reward, **options: Any) -> RewardResult:
        return await score_program(program, reward, provider=provider, **options)

    return run
