"""The examples run as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples"


def _run(name: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_shell_episode() -> None:
    out = _run("shell_episode.py")
    assert out.rstrip().endswith("rewards: right=1.0 wrong=0.0")
    assert "GET /index.html" in out  # the background server answered in a later step


def test_score_candidates() -> None:
    assert _run("score_candidates.py") == "[1.0, 0.0]\n"
