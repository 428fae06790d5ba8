"""Rewards made of rewards: a weighted sum, and all-of."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from rollbox.errors import ConfigError
from rollbox.rewards.base import Reward, Sample, check_name
from rollbox.rewards.result import RewardResult


def _unique(rewards: Iterable[Reward], owner: str) -> list[Reward]:
    rewards = list(rewards)
    if not rewards:
        raise ConfigError(f"{owner}: give at least one reward")
    seen: set[str] = set()
    for reward in rewards:
        if not isinstance(reward, Reward):
            raise ConfigError(f"{owner}: {reward!r} is not a rollbox reward")
        if reward.name in seen:
            raise ConfigError(
                f"{owner}: two rewards are named {reward.name!r}; give one a name=... of its own"
            )
        seen.add(reward.name)
    return rewards


class _Composite(Reward):
    children: list[Reward]

    @property
    def uses_sandbox(self) -> bool:  # type: ignore[override]
        return any(child.uses_sandbox for child in self.children)

    async def _score_child(self, child: Reward, sample: Sample, ran_code: bool) -> RewardResult:
        # What one check started (a daemon the solution forked) must not tamper with the next.
        if ran_code and child.uses_sandbox and sample.sandbox is not None:
            from rollbox.envs.verify import stop_agent_processes  # on use: envs imports us

            problem = await stop_agent_processes(sample.sandbox)
            if problem is not None:
                return RewardResult(
                    score=0.0, components={child.name: 0.0}, details={"error": problem}
                )
        return await child.score(sample)


def _merge(name: str, result: RewardResult, components: dict[str, float]) -> None:
    components[name] = result.score
    for key, value in result.components.items():
        if key != name:
            components[f"{name}.{key}"] = value


class Weighted(_Composite):
    """The weighted sum of rewards: ``Weighted({PythonTests(...): 1.0, CodeBlock(): 0.1})``.

    Children run one after the other on the same sample; every process that one left running
    is killed before the next runs.
    """

    def __init__(
        self,
        weights: Mapping[Reward, float] | Iterable[tuple[Reward, float]],
        *,
        name: str | None = None,
    ) -> None:
        pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
        self.children = _unique((reward for reward, _ in pairs), "Weighted")
        self.weights = []
        for reward, weight in pairs:
            if (
                isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not math.isfinite(weight)
            ):
                raise ConfigError(
                    f"Weighted: the weight of {reward.name!r} must be a number, not {weight!r}"
                )
            self.weights.append(float(weight))
        self.name = check_name(name, "weighted")

    async def score(self, sample: Sample) -> RewardResult:
        total = 0.0
        components: dict[str, float] = {}
        details: dict[str, Any] = {}
        ran_code = False
        for child, weight in zip(self.children, self.weights, strict=True):
            result = await self._score_child(child, sample, ran_code)
            ran_code = ran_code or child.uses_sandbox
            total += weight * result.score
            _merge(child.name, result, components)
            details[child.name] = dict(result.details)
        return RewardResult(score=total, components=components, details=details)


class AllOf(_Composite):
    """1.0 if every reward scores at least ``threshold`` (default 1.0), else 0.0.

    Children run in order and scoring stops at the first that falls short.
    """

    def __init__(self, *rewards: Reward, threshold: float = 1.0, name: str | None = None) -> None:
        self.children = _unique(rewards, "AllOf")
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not math.isfinite(threshold)
        ):
            raise ConfigError(f"AllOf: threshold must be a number, not {threshold!r}")
        self.threshold = float(threshold)
        self.name = check_name(name, "all_of")

    async def score(self, sample: Sample) -> RewardResult:
        components: dict[str, float] = {}
        details: dict[str, Any] = {}
        ran_code = False
        for child in self.children:
            result = await self._score_child(child, sample, ran_code)
            ran_code = ran_code or child.uses_sandbox
            _merge(child.name, result, components)
            details[child.name] = dict(result.details)
            if result.score < self.threshold:
                details["failed"] = child.name
                return RewardResult(score=0.0, components=components, details=details)
        return RewardResult(score=1.0, components=components, details=details)


weighted = Weighted
all_of = AllOf
