"""Reward functions (imported as ``rollbox.rewards``)."""
