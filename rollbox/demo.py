"""``rollbox demo``: score candidate programs for tiny Python tasks, each in its own sandbox.

The hidden tests are (arguments, expected result) pairs kept on the host. At scoring time only
the arguments are written into the sandbox; the candidate's results come back as JSON and are
compared on the host, so the expected answers never enter a sandbox at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from rollbox.errors import ConfigError, RollboxError
from rollbox.sandbox.base import AsyncSandbox
from rollbox.sandbox.models import Limits

_MARKER = "__ROLLBOX_RESULTS__ "

# The harness that runs at scoring time: call the candidate on each hidden input.
_HARNESS = f"""\
import json, sys
import solution
inputs = json.load(open("/work/inputs.json"))
function = getattr(solution, sys.argv[1])
print({_MARKER!r} + json.dumps([function(*args) for args in inputs]))
"""

_FIZZBUZZ_15 = [
    "1", "2", "Fizz", "4", "Buzz", "Fizz", "7", "8", "Fizz", "Buzz", "11", "Fizz", "13", "14",
    "FizzBuzz",
]  # fmt: skip

# name -> (function, hidden tests as (args, expected))
TASKS: dict[str, tuple[str, list[tuple[list[Any], Any]]]] = {
    "add": ("add", [([1, 2], 3), ([-5, 5], 0), ([10**12, 1], 10**12 + 1)]),
    "reverse": ("reverse", [(["abc"], "cba"), ([""], ""), (["racecar!"], "!racecar")]),
    "fizzbuzz": ("fizzbuzz", [([5], _FIZZBUZZ_15[:5]), ([15], _FIZZBUZZ_15)]),
    "is_prime": ("is_prime", [([1], False), ([2], True), ([9], False), ([97], True)]),
}

_FIZZBUZZ = """\
def fizzbuzz(n):
    out = []
    for i in range(1, n + 1):
        out.append("Fizz" * (i % 3 == 0) + "Buzz" * (i % 5 == 0) or str(i))
    return out
"""

# (task, candidate name, the reward it should get, its source)
CANDIDATES: list[tuple[str, str, float, str]] = [
    ("add", "correct", 1.0, "def add(a, b):\n    return a + b\n"),
    ("add", "wrong", 0.0, "def add(a, b):\n    return a - b\n"),
    ("add", "crashes", 0.0, "def add(a, b):\n    return a + c\n"),
    ("reverse", "correct", 1.0, "def reverse(s):\n    return s[::-1]\n"),
    ("reverse", "wrong", 0.0, "def reverse(s):\n    return s\n"),
    (
        "reverse",
        "reads-host-file",
        0.0,
        "def reverse(s):\n    return open('/etc/shadow').read()  # the host's, if it could\n",
    ),
    ("fizzbuzz", "correct", 1.0, _FIZZBUZZ),
    ("fizzbuzz", "wrong", 0.0, _FIZZBUZZ.replace("i % 5 == 0", "i % 5 == 1")),
    ("fizzbuzz", "loops-forever", 0.0, "def fizzbuzz(n):\n    while True:\n        pass\n"),
    (
        "is_prime",
        "correct",
        1.0,
        "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
    ),
    ("is_prime", "wrong", 0.0, "def is_prime(n):\n    return n % 2 == 1 or n == 2\n"),
    (
        "is_prime",
        "fork-bomb",
        0.0,
        "import os\n\ndef is_prime(n):\n    while True:\n        try:\n            os.fork()\n"
        "        except OSError:\n            pass\n",
    ),
]

# Small sandboxes: enough for a Python function, and a fork bomb hits pids.max at once.
DEMO_LIMITS = Limits(memory_mb=256, pids=32, cpus=0.5, disk_mb=64)


@dataclass
class Score:
    """One candidate's row of the demo table."""

    task: str
    candidate: str
    reward: float | None  # None: the sandbox failed (infrastructure), not the candidate
    expected: float
    result: str  # "exit 0", "exit 1: NameError: ...", "timeout", "error: ..."
    ms: float


async def score_candidate(
    task: str, candidate: str, expected: float, source: str, *, provider: Any, timeout: float
) -> Score:
    """Run one candidate against its task's hidden tests in a fresh sandbox."""
    function, tests = TASKS[task]
    start = time.perf_counter()
    try:
        async with await AsyncSandbox.create(
            f"demo-{task}-{candidate}", provider=provider, limits=DEMO_LIMITS, ttl_seconds=60
        ) as box:
            await box.files.write("solution.py", source)
            # Scoring time: only now do the hidden inputs (never the answers) enter the sandbox.
            await box.files.write("score.py", _HARNESS)
            await box.files.write("inputs.json", json.dumps([args for args, _ in tests]))
            run = await box.commands.run(f"python score.py {function}", timeout_seconds=timeout)
    except RollboxError as exc:
        ms = (time.perf_counter() - start) * 1000
        return Score(task, candidate, None, expected, f"error: {exc}", round(ms, 1))
    ms = (time.perf_counter() - start) * 1000
    outputs = None
    for line in reversed(run.stdout.splitlines()):
        if line.startswith(_MARKER):
            with contextlib.suppress(ValueError):  # garbled output scores 0
                outputs = json.loads(line[len(_MARKER) :])
            break
    answers = json.loads(json.dumps([answer for _, answer in tests]))  # tuples -> lists
    reward = 1.0 if run.ok and outputs == answers else 0.0
    if run.timed_out:
        result = f"timeout ({timeout:g} s)"
    elif run.exit_code != 0:
        last = (run.stderr.strip().splitlines() or [""])[-1]
        result = f"exit {run.exit_code}: {last}"[:60]
    else:
        result = "exit 0"
    return Score(task, candidate, reward, expected, result, round(ms, 1))


async def run_demo(n_concurrent: int = 8, timeout: float = 1.0) -> tuple[list[Score], float]:
    """Score every candidate, ``n_concurrent`` sandboxes at a time; returns rows and wall time."""
    from rollbox.sandbox.local import LocalProvider

    if n_concurrent < 1:
        raise ConfigError(f"n_concurrent must be at least 1, got {n_concurrent}")
    provider = LocalProvider()
    gate = asyncio.Semaphore(n_concurrent)

    async def one(task: str, name: str, expected: float, source: str) -> Score:
        async with gate:
            return await score_candidate(
                task, name, expected, source, provider=provider, timeout=timeout
            )

    start = time.perf_counter()
    try:
        scores = await asyncio.gather(*(one(*candidate) for candidate in CANDIDATES))
    finally:
        await provider.close()
    return list(scores), time.perf_counter() - start


def to_json(scores: list[Score], wall: float, n_concurrent: int) -> dict[str, Any]:
    """The machine-readable result of ``rollbox demo --json``."""
    return {
        "results": [asdict(score) for score in scores],
        "sandboxes": len(scores),
        "wall_s": round(wall, 3),
        "sandboxes_per_s": round(len(scores) / wall, 1),
        "n_concurrent": n_concurrent,
        "as_expected": all(s.reward == s.expected for s in scores),
    }


def format_table(scores: list[Score], wall: float, n_concurrent: int) -> str:
    """The human-readable table and totals."""
    rows = [("task", "candidate", "reward", "result", "ms")]
    for s in scores:
        reward = "error" if s.reward is None else f"{s.reward:.1f}"
        rows.append((s.task, s.candidate, reward, s.result, f"{s.ms:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [
        f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d:<{widths[3]}}  {e:>{widths[4]}}"
        for a, b, c, d, e in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    wrong = [s for s in scores if s.reward != s.expected]
    passed = sum(1 for s in scores if s.reward == 1.0)
    lines += [
        "",
        f"{len(scores)} sandboxes in {wall:.2f} s wall, {len(scores) / wall:.1f} sandboxes/s "
        f"(n_concurrent={n_concurrent}); {passed} of {len(scores)} candidates scored 1.0",
    ]
    if wrong:
        names = ", ".join(f"{s.task}/{s.candidate}" for s in wrong)
        lines.append(f"UNEXPECTED rewards for: {names}")
    else:
        lines.append("every reward is as expected: correct ones 1.0, the rest 0.0")
    return "\n".join(lines)
