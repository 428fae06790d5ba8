"""RewardResult: what scoring an episode or a completion gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollbox.errors import ConfigError


class RewardResult(BaseModel):
    """A score with the parts it was made of and what the scorer saw.

    ``components`` are named sub-scores (``{"tests": 1.0}``); ``details`` is free-form and meant
    for people (exit codes, output tails), never for training.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    score: float
    components: dict[str, float] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def failure(cls, reason: str, name: str | None = None, **details: Any) -> RewardResult:
        """0.0 for a failure of the model's output, with the reason kept for people."""
        return cls(
            score=0.0,
            components={name: 0.0} if name else {},
            details={"error": reason, **details},
        )

    @property
    def error(self) -> str | None:
        """Why the output failed, when the scorer said so."""
        error = self.details.get("error")
        return error if isinstance(error, str) else None

    @classmethod
    def coerce(cls, value: object, *, name: str = "reward") -> RewardResult:
        """Turn what a reward function returned into a RewardResult.

        Accepts a number (or bool), a RewardResult, a mapping with ``score``, or any object with
        a ``score`` attribute (and optionally ``components`` and ``details``).

        Raises:
            ConfigError: the value is none of those.
        """
        if isinstance(value, RewardResult):
            return value
        if isinstance(value, bool | int | float) and not isinstance(value, complex):
            score = float(value)
            return cls(score=score, components={name: score})
        if isinstance(value, Mapping) and "score" in value:
            data = dict(value)
        elif hasattr(value, "score"):
            data = {
                "score": value.score,
                "components": getattr(value, "components", None) or {},
                "details": getattr(value, "details", None) or {},
            }
        else:
            raise ConfigError(
                f"{name} returned {type(value).__name__}; return a float or a RewardResult"
            )
        try:
            return cls.model_validate(data)
        except ValueError as exc:
            raise ConfigError(f"{name} returned an invalid result: {exc}") from exc
