"""Helpers for the environment tests: small tasks whose verifier is a shell test."""

from __future__ import annotations

from typing import Any

from rollbox.envs import Task


def answer_task(expected: str = "42", **fields: Any) -> Task:
    """A task solved by writing ``expected`` to /work/answer.txt; the hidden test checks it."""
    values: dict[str, Any] = {
        "id": "answer",
        "instruction": f"Write {expected} to /work/answer.txt, then submit.",
        "verifier": {
            "command": 'sh "$TESTS_DIR/check.sh"',
            "files": {"check.sh": f'test "$(cat /work/answer.txt)" = "{expected}"\n'},
        },
        "max_turns": 10,
        "step_timeout_seconds": 20,
    }
    values.update(fields)
    return Task(**values)
