"""exit_code and output_match: commands in real sandboxes, outputs compared on the host."""

from __future__ import annotations

import pytest

from rollbox import AsyncSandbox
from rollbox.errors import ConfigError
from rollbox.rewards import Column, ExitCode, OutputMatch, Sample, json_equal
from tests.rewards.conftest import Score

# A hidden check that reads the nonce before the solution runs and prints it only at the end.
CHECK = """\
import sys
nonce = sys.stdin.readline()
sys.path.insert(0, "/work")
from solution import add
assert add(2, 3) == 5
print(nonce, end="")
"""


async def test_exit_code_scores_the_command(score: Score) -> None:
    reward = ExitCode('python3 "$TESTS_DIR/check.py"', files={"check.py": CHECK}, stdin_nonce=True)
    good = await score("def add(a, b):\n    return a + b\n", reward)
    assert good.score == 1.0 and good.components == {"exit_code": 1.0}
    assert good.details["nonce_confirmed"] is True
    assert (await score("def add(a, b):\n    return a - b\n", reward)).score == 0.0


async def test_exiting_0_early_does_not_pass_a_nonce_check(score: Score) -> None:
    reward = ExitCode('python3 "$TESTS_DIR/check.py"', files={"check.py": CHECK}, stdin_nonce=True)
    early = await score("import os\nos._exit(0)\n", reward)
    assert early.score == 0.0
    assert early.details["exit_code"] == 0 and early.details["nonce_confirmed"] is False


async def test_exit_code_times_out(score: Score) -> None:
    reward = ExitCode("sleep 5", timeout_seconds=0.5)
    result = await score("", reward)
    assert result.score == 0.0 and result.details["timed_out"] is True


async def test_output_match_modes(score: Score) -> None:
    program = "import sys, json\nname = sys.stdin.read().strip()\nprint(json.dumps({'hello': name, 'n': [1, 2.0]}))\n"
    command = "python3 solution.py"
    exact = OutputMatch(command, '{"hello": "ada", "n": [1, 2.0]}\n\n', stdin="ada\n")
    assert (await score(program, exact)).score == 1.0
    regex = OutputMatch(command, r'\{"hello": "a\w+".*\}', stdin="ada", mode="regex")
    assert (await score(program, regex)).score == 1.0
    as_json = OutputMatch(command, {"n": (1.0, 2), "hello": "ada"}, stdin="ada", mode="json")
    assert (await score(program, as_json)).score == 1.0
    wrong = OutputMatch(command, {"hello": "bob", "n": [1, 2]}, stdin="ada", mode="json")
    result = await score(program, wrong)
    assert result.score == 0.0
    assert result.details["results"][0]["reason"] == "a different JSON value"


async def test_output_match_cases_give_the_fraction(score: Score) -> None:
    program = "n = int(input())\nprint(n * n if n < 3 else -1)\n"
    cases = [
        {"input": "1\n", "output": "1"},
        {"stdin": "2\n", "expected": "4"},
        ("3\n", "9"),
        ("4", "16"),
    ]
    reward = OutputMatch("python3 solution.py", cases=Column("cases"))
    result = await score(program, reward, row={"cases": cases})
    assert result.score == 0.5
    assert [r["passed"] for r in result.details["results"]] == [True, True, False, False]


async def test_output_match_needs_a_clean_exit_unless_told(score: Score) -> None:
    program = "print('42')\nraise SystemExit(3)\n"
    assert (await score(program, OutputMatch("python3 solution.py", "42"))).score == 0.0
    lenient = OutputMatch("python3 solution.py", "42", require_exit_zero=False)
    assert (await score(program, lenient)).score == 1.0


async def test_printing_a_success_marker_is_not_the_answer(score: Score) -> None:
    program = "print('PASSED')\nprint('ok')\nprint('42')\nprint('All tests passed')\n"
    assert (await score(program, OutputMatch("python3 solution.py", "42"))).score == 0.0


async def test_the_expected_output_never_enters_the_sandbox(provider: object) -> None:
    secret = "expected-93c1d7"
    reward = OutputMatch("cat /dev/stdin > /dev/null; echo no", secret, stdin="input-only")
    async with await AsyncSandbox.create(provider=provider) as sandbox:  # type: ignore[arg-type]
        result = await reward.score(Sample(sandbox=sandbox))
        assert result.score == 0.0
        search = f"grep -rl {secret} /work /tmp /proc/1/cmdline /proc/1/environ; echo done"
        assert (await sandbox.commands.run(search, cwd="/")).stdout == "done\n"


def test_json_equal_is_strict_about_bools_and_lenient_about_number_types() -> None:
    assert json_equal([1, {"a": 2.0}], (1.0, {"a": 2}))
    assert not json_equal(True, 1) and not json_equal([0], [False])
    assert not json_equal({"a": 1}, {"a": 1, "b": None})
    assert not json_equal("1", 1) and json_equal(None, None)


def test_output_match_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="either expected"):
        OutputMatch("true")
    with pytest.raises(ConfigError, match="mode must be"):
        OutputMatch("true", "x", mode="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="each case carries its own stdin"):
        OutputMatch("true", cases=[("", "")], stdin="x")


async def test_output_match_bad_regex_is_a_config_error(score: Score) -> None:
    with pytest.raises(ConfigError, match="invalid regex"):
        await score("", OutputMatch("echo x", "(", mode="regex"))
