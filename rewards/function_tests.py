"""python_tests: function-completion tasks (HumanEval, MBPP) scored test by test.

The tests run in a judge process that never runs the solution; the solution answers calls from
a process of its own, and only plain data crosses between them (see ``_judge.py``). The tests
reach the sandbox on the judge's stdin at scoring time and are never written to a file.
"""

from __future__ import annotations

import functools
import json
import math
import secrets
import shlex
from pathlib import Path
from typing import Any

from rollbox.errors import CommandError, ConfigError
from rollbox.rewards import _judge
from rollbox.rewards.base import Column, Reward, Sample, check_name, clip_detail, resolve
from rollbox.rewards.result import RewardResult

SOLUTION_PATH = "/work/solution.py"


@functools.cache
def judge_source() -> str:
    return Path(_judge.__file__).read_text(encoding="utf-8")


class PythonTests(Reward):
    """Score a Python function by hidden tests; the score is the fraction of tests that pass.

    Args:
        tests: test code, either a ``check(candidate)`` function (HumanEval: each statement of
            its body that holds an assert is one test) or top-level asserts calling the function
            by name (MBPP), or a list of test snippets (one test each). May be a ``Column``.
        entry_point: the function's name (a ``Column`` too, e.g. ``Column("entry_point")``).
        context: trusted code run before the tests in the judge, e.g. HumanEval's prompt, whose
            helpers some tests call. Never the model's code.
        solution_path: the file in the sandbox that defines the function.
        partial_credit: if False, the score is 1.0 when every test passes, else 0.0 (the
            fraction is still in ``details``).
        test_timeout_seconds: time for each test statement (a slow call fails that test only).
        timeout_seconds: time for the whole run; tests not reached by then fail.
        python: the sandbox's Python interpreter.

    ``details`` holds ``passed`` (test names), ``failed`` (name and error), ``fraction``.
    """

    def __init__(
        self,
        tests: str | list[str] | Column,
        entry_point: str | Column,
        *,
        context: str | Column | None = None,
        solution_path: str = SOLUTION_PATH,
        partial_credit: bool = True,
        test_timeout_seconds: float = 10.0,
        timeout_seconds: float = 60.0,
        python: str = "python3",
        name: str | None = None,
    ) -> None:
        for label, value in (
            ("test_timeout_seconds", test_timeout_seconds),
            ("timeout_seconds", timeout_seconds),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"PythonTests: {label} must be a positive number, not {value!r}")
        self.tests = tests
        self.entry_point = entry_point
        self.context = context
        self.solution_path = solution_path
        self.partial_credit = partial_credit
        self.test_timeout_seconds = float(test_timeout_seconds)
        self.timeout_seconds = float(timeout_seconds)
        self.python = python
        self.name = check_name(name, "python_tests")

    def _arguments(self, sample: Sample) -> tuple[str | list[str], str, str | None]:
        tests = resolve(self.tests, sample, "tests")
        entry_point = resolve(self.entry_point, sample, "entry_point")
        context = resolve(self.context, sample, "context")
        if not (
            isinstance(tests, str)
            or (isinstance(tests, list) and all(isinstance(t, str) for t in tests))
        ):
            raise ConfigError(
                f"PythonTests: tests must be test code (str) or a list of str, not {type(tests).__name__}"
            )
        if not isinstance(entry_point, str) or not entry_point.isidentifier():
            raise ConfigError(
                f"PythonTests: entry_point must be a Python name, not {entry_point!r}"
            )
        if context is not None and not isinstance(context, str):
            raise ConfigError(
                f"PythonTests: context must be code (str), not {type(context).__name__}"
            )
        return tests, entry_point, context

    async def score(self, sample: Sample) -> RewardResult:
        sandbox = sample.need_sandbox(self)
        tests, entry_point, context = self._arguments(sample)
        try:
            numbered = _judge.numbered_tests(tests)
        except SyntaxError as exc:
            raise ConfigError(f"PythonTests: the tests are not valid Python: {exc}") from exc
        if not numbered:
            raise ConfigError(
                "PythonTests: the tests hold no assert statement, so nothing is tested"
            )
        nonce = secrets.token_hex(16)
        secrets_line = json.dumps(
            {
                "nonce": nonce,
                "tests": tests,
                "entry_point": entry_point,
                "context": context,
                "solution_path": self.solution_path,
                "test_timeout_seconds": self.test_timeout_seconds,
            }
        )
        stdin = _judge.boot_header(judge_source(), "j") + secrets_line.encode() + b"\n"
        command = f"exec {self.python} -I -c {shlex.quote(_judge.BOOTSTRAP)}"
        try:
            run = await sandbox.commands.run(
                command, cwd="/", stdin=stdin, timeout_seconds=self.timeout_seconds
            )
        except CommandError as exc:  # e.g. the pids limit is held by what the solution left
            return RewardResult.failure(f"the tests could not start: {exc}", self.name)
        return self._verdict(numbered, nonce, run)

    def _verdict(self, tests: list[tuple[int, str]], nonce: str, run: Any) -> RewardResult:
        outcome: dict[int, str | None] = {}  # unit index -> None (passed) or the error
        setup_errors: list[str] = []
        problems: list[str] = []
        finished = False
        prefix = nonce + " "
        for line in run.stdout.splitlines():
            if not line.startswith(prefix):
                continue  # only the judge knows the nonce
            try:
                record = json.loads(line[len(prefix) :])
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            if record.get("end") is True:
                finished = True
            elif isinstance(record.get("test"), int):
                passed = record.get("passed") is True
                outcome[record["test"]] = None if passed else str(record.get("error"))
            elif "setup" in record:
                setup_errors.append(str(record.get("error")))
            elif "error" in record or "warning" in record:
                problems.append(str(record.get("error") or record.get("warning")))
        passed_names, failed = [], []
        for unit, name in tests:
            if unit in outcome and outcome[unit] is None:
                passed_names.append(name)
                continue
            error = outcome.get(unit) or (
                "not run: the run timed out first" if run.timed_out else "not run"
            )
            failed.append({"test": name, "error": error})
        fraction = len(passed_names) / len(tests)
        score = fraction if self.partial_credit else float(fraction == 1.0)
        details: dict[str, Any] = {
            "fraction": fraction,
            "passed": passed_names,
            "failed": failed,
            "exit_code": run.exit_code,
            "timed_out": run.timed_out,
            "complete": finished,
        }
        if setup_errors:
            details["setup_errors"] = setup_errors[:10]
        if problems:
            details["error"] = "; ".join(problems)
        stderr = run.stderr.replace(nonce, "<nonce>")
        if stderr.strip():
            details["stderr"] = clip_detail(stderr)
        return RewardResult(score=score, components={self.name: score}, details=details)


python_tests = PythonTests
