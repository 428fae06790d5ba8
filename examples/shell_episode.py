"""A scripted agent solves a small shell task over several steps, in one sandbox.

The task: serve a page from a background HTTP server, fetch it, and save what came back. The
server started in one step must still run in the next. Hidden tests (uploaded only after the
agent's last step) score the result: the right agent gets 1.0, a wrong one 0.0.

    python examples/shell_episode.py
"""

from __future__ import annotations

import gymnasium

from rollbox.envs import Task  # importing rollbox.envs registers rollbox/Shell-v0

TASK = Task(
    id="serve-and-fetch",
    instruction=(
        "Put the text 'hello from rollbox' in /work/site/index.html, serve /work/site with an "
        "HTTP server on 127.0.0.1:8000 that keeps running in the background, fetch "
        "http://127.0.0.1:8000/index.html and save the body to /work/fetched.txt. Then submit."
    ),
    verifier={
        "command": 'python3 "$TESTS_DIR/test_fetched.py"',
        "files": {
            "test_fetched.py": (
                "body = open('/work/fetched.txt').read()\n"
                "assert body == 'hello from rollbox\\n', body\n"
                "assert 'GET /index.html' in open('/work/server.log').read()\n"
            )
        },
    },
    max_turns=8,
    step_timeout_seconds=30,
)

FETCH = """python3 - <<'EOF'
import time, urllib.request
for _ in range(100):  # the server may still be starting
    try:
        body = urllib.request.urlopen("http://127.0.0.1:8000/index.html").read()
        break
    except OSError:
        time.sleep(0.1)
open("/work/fetched.txt", "wb").write(body)
print(body.decode(), end="")
EOF"""

RIGHT_AGENT = [
    {"tool": "write_file", "path": "site/index.html", "content": "hello from rollbox\n"},
    "python3 -m http.server 8000 --bind 127.0.0.1 --directory site >server.log 2>&1 &",
    FETCH,
    "cat fetched.txt; tail -n 1 server.log",
    {"tool": "submit"},
]

WRONG_AGENT = [
    {"tool": "write_file", "path": "site/index.html", "content": "hello\n"},
    "python3 -m http.server 8000 --bind 127.0.0.1 --directory site >server.log 2>&1 &",
    FETCH,
    {"tool": "submit"},
]


def run(env: gymnasium.Env, name: str, actions: list[object]) -> float:
    """Play ``actions`` as one episode and return the final reward."""
    obs, info = env.reset()
    print(f"== {name} (sandbox {info['sandbox_id']})\n{obs}\n")
    reward = 0.0
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        print(f"> {action}\n{obs}\n")
        if terminated or truncated:
            break
    print(f"reward: {reward} {info['reward_components']}\n")
    return float(reward)


def main() -> None:
    env = gymnasium.make("rollbox/Shell-v0", task=TASK)
    try:
        right = run(env, "right agent", RIGHT_AGENT)
        wrong = run(env, "wrong agent", WRONG_AGENT)
    finally:
        env.close()
    print(f"rewards: right={right} wrong={wrong}")


if __name__ == "__main__":
    main()
