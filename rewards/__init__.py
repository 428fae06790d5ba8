"""Reward functions: pure, and sandbox-executed (imported as ``rollbox.rewards``)."""

from rollbox.rewards.result import RewardResult

__all__ = ["RewardResult"]
