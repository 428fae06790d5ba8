"""The reward protocol: a Reward scores one Sample (a sandbox, the model's text, a dataset row).

A reward is also a Task verifier: ``Task(verifier=PythonTests(...))`` works, because calling a
reward with ``(sandbox, task)`` scores that sandbox with the task's metadata as the row.

Policy failure is not infrastructure failure: code that the model wrote and that fails scores
0.0 (the reason is in ``details``); a sandbox that could not start or died raises one of
``INFRASTRUCTURE_ERRORS``, which callers turn into "no reward" (``None`` for TRL), never 0.0.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from rollbox.errors import (
    ConfigError,
    SandboxDeadError,
    SandboxStartError,
    TooManySandboxesError,
)
from rollbox.rewards.result import RewardResult

if TYPE_CHECKING:
    from rollbox.envs.task import Task
    from rollbox.sandbox.base import AsyncSandbox

log = logging.getLogger("rollbox.rewards")

# What no model output can cause: the sample gets no reward (None), and the error is logged.
INFRASTRUCTURE_ERRORS: tuple[type[Exception], ...] = (
    SandboxStartError,
    SandboxDeadError,
    TooManySandboxesError,
)

DETAIL_CHARS = 2000


@dataclass(frozen=True)
class Sample:
    """What one reward call scores.

    Attributes:
        sandbox: where the model's program or episode ran (None for text-only scoring).
        completion: the model's text (None when scoring a multi-turn episode's final state).
        row: the dataset row (TRL columns, or the task's ``metadata``); ``Column`` reads it.
        task: the task of a multi-turn episode, if any.
    """

    sandbox: AsyncSandbox | None = None
    completion: str | None = None
    row: Mapping[str, Any] = field(default_factory=dict)
    task: Task | None = None

    def need_sandbox(self, reward: Reward) -> AsyncSandbox:
        if self.sandbox is None:
            raise ConfigError(f"reward {reward.name!r} runs commands and needs a sandbox")
        return self.sandbox

    def need_text(self, reward: Reward) -> str:
        if self.completion is None:
            raise ConfigError(
                f"reward {reward.name!r} scores the model's text, and this sample has none "
                "(a multi-turn episode is scored from its sandbox)"
            )
        return self.completion


@dataclass(frozen=True)
class Column:
    """A reward argument read from the sample's row: ``PythonTests(tests=Column("test"), ...)``.

    A missing column is a ConfigError naming it, unless ``default`` is given.
    """

    name: str
    default: Any = ...

    def read(self, sample: Sample, argument: str) -> Any:
        if self.name in sample.row:
            return sample.row[self.name]
        if self.default is not ...:
            return self.default
        known = ", ".join(sorted(map(str, sample.row))) or "none"
        raise ConfigError(
            f"{argument}=Column({self.name!r}): the row has no column {self.name!r} "
            f"(its columns: {known})"
        )


def resolve(value: Any, sample: Sample, argument: str) -> Any:
    """``value``, or the row's column if it is a ``Column``."""
    return value.read(sample, argument) if isinstance(value, Column) else value


class Reward(ABC):
    """A reward function: ``await reward.score(sample) -> RewardResult``.

    ``uses_sandbox`` says whether it runs anything in ``sample.sandbox`` (text rewards do not,
    so scoring them starts no sandbox).
    """

    uses_sandbox: ClassVar[bool] = True
    name: str

    @abstractmethod
    async def score(self, sample: Sample) -> RewardResult:
        """Score one sample; raises only for infrastructure failures and bad configuration."""

    async def __call__(self, sandbox: AsyncSandbox, task: Task) -> RewardResult:
        """Score a multi-turn episode's final state: the Task verifier form."""
        return await self.score(Sample(sandbox=sandbox, row=task.metadata, task=task))

    @property
    def __name__(self) -> str:  # the name verifiers and TRL show
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def clip_detail(text: str, limit: int = DETAIL_CHARS) -> str:
    """The tail of ``text``, which is where errors are."""
    return text if len(text) <= limit else "..." + text[-limit:]


def check_name(name: object, default: str) -> str:
    if name is None:
        return default
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"a reward's name must be a non-empty string, not {name!r}")
    return name
