"""Weighted sums and all-of, over real sandbox rewards and text rewards."""

from __future__ import annotations

import pytest

from rollbox.errors import ConfigError
from rollbox.rewards import (
    AllOf,
    CodeBlock,
    ExitCode,
    LengthBudget,
    OutputMatch,
    PythonTests,
    Weighted,
)
from tests.rewards.conftest import Score

TESTS = PythonTests(tests="assert f(2) == 4\nassert f(3) == 9\n", entry_point="f")
ANSWER = "```python\ndef f(x):\n    return x * x\n```"


async def test_weighted_sums_children_and_keeps_their_parts(score: Score) -> None:
    reward = Weighted({TESTS: 1.0, CodeBlock(): 0.25, LengthBudget(10): 0.5})
    result = await score("def f(x):\n    return x * x\n", reward, completion=ANSWER)
    assert result.score == pytest.approx(1.0 + 0.25 + 0.5 * 0.0)
    assert result.components == {"python_tests": 1.0, "code_block": 1.0, "length": 0.0}
    assert result.details["python_tests"]["fraction"] == 1.0


async def test_all_of_stops_at_the_first_shortfall(score: Score) -> None:
    never = ExitCode("touch /work/ran; false", name="never")
    reward = AllOf(CodeBlock(), TESTS, never, OutputMatch("cat /work/ran", "", name="after"))
    result = await score("def f(x):\n    return x * x\n", reward, completion=ANSWER)
    assert result.score == 0.0 and result.details["failed"] == "never"
    assert set(result.components) == {"code_block", "python_tests", "never"}
    passing = AllOf(CodeBlock(), TESTS)
    assert (await score("def f(x):\n    return x * x\n", passing, completion=ANSWER)).score == 1.0


async def test_a_daemon_left_by_one_check_is_killed_before_the_next(score: Score) -> None:
    # the first check starts the program, which leaves a process that would answer the second
    leave = ExitCode(
        "setsid sh -c 'while true; do echo 42 > /work/answer; sleep 0.01; done' >/dev/null 2>&1 & sleep 0.2",
        name="leave",
    )
    check = OutputMatch(
        "rm -f /work/answer; sleep 0.3; cat /work/answer 2>/dev/null || echo none",
        "none",
        name="clean",
    )
    result = await score("", Weighted([(leave, 0.0), (check, 1.0)]))
    assert result.components["clean"] == 1.0, result.details


def test_composites_refuse_duplicate_names_and_bad_weights() -> None:
    with pytest.raises(ConfigError, match="two rewards are named 'code_block'"):
        AllOf(CodeBlock(), CodeBlock())
    with pytest.raises(ConfigError, match="must be a number"):
        Weighted({CodeBlock(): "1"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="at least one reward"):
        AllOf()
    assert not Weighted({CodeBlock(): 1.0}).uses_sandbox
    assert Weighted({CodeBlock(): 1.0, TESTS: 1.0}).uses_sandbox
