"""Rewards that run a command: its exit code, or its output compared on the host."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from rollbox.errors import CommandError, ConfigError
from rollbox.rewards.base import Column, Reward, Sample, check_name, clip_detail, resolve
from rollbox.rewards.result import RewardResult

if TYPE_CHECKING:
    from rollbox.envs.task import TaskFile

MatchMode = Literal["exact", "regex", "json"]
# Sandboxed output is hostile: what the host parses or matches is capped.
_MATCH_CHARS = 1_000_000
_REGEX_CHARS = 65_536


def _positive(owner: str, label: str, value: object) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{owner}: {label} must be a positive number, not {value!r}")
    return float(value)


class ExitCode(Reward):
    """1.0 if ``command`` exits 0 in time, else 0.0.

    ``files`` (relative paths) are hidden files uploaded at scoring time to a fresh directory,
    ``$TESTS_DIR``. With ``stdin_nonce=True`` the command reads a random line on stdin and
    passes only if it also prints it, so code that exits 0 early does not pass: the test
    script reads the line first and prints it last.
    """

    def __init__(
        self,
        command: str | Column,
        *,
        files: Mapping[str, str | bytes | TaskFile] | Column | None = None,
        cwd: str = "/work",
        env: Mapping[str, str] | None = None,
        stdin_nonce: bool = False,
        timeout_seconds: float = 60.0,
        name: str | None = None,
    ) -> None:
        self.command = command
        self.files = files
        self.cwd = cwd
        self.env = dict(env or {})
        self.stdin_nonce = stdin_nonce
        self.timeout_seconds = _positive("ExitCode", "timeout_seconds", timeout_seconds)
        self.name = check_name(name, "exit_code")

    async def score(self, sample: Sample) -> RewardResult:
        from rollbox.envs.task import TestsVerifier  # on use: envs imports this package
        from rollbox.envs.verify import run_tests

        sandbox = sample.need_sandbox(self)
        verifier = TestsVerifier(
            command=resolve(self.command, sample, "command"),
            files=resolve(self.files, sample, "files") or {},
            cwd=self.cwd,
            env=self.env,
            stdin_nonce=self.stdin_nonce,
            timeout_seconds=self.timeout_seconds,
        )
        result = await run_tests(sandbox, verifier)
        return RewardResult(
            score=result.score, components={self.name: result.score}, details=result.details
        )


class OutputMatch(Reward):
    """Run ``command`` and compare its stdout on the host with what is expected.

    One check (``expected``, with optional ``stdin``) or several (``cases``: a list of
    ``{"stdin": ..., "expected": ...}`` dicts, ``input``/``output`` also accepted, or
    ``(stdin, expected)`` pairs); the score is the fraction that match. Expected outputs never
    enter the sandbox: inputs go on the command's stdin, outputs come back and are compared here.

    Modes: ``exact`` (equal after trimming trailing whitespace of every line and blank lines at
    both ends; ``strip=False`` compares raw), ``regex`` (``expected`` is a pattern that must
    match the whole trimmed output; use patterns without nested repetition: the output is
    hostile), ``json`` (stdout parsed as JSON equals ``expected``, a Python value; ``True`` and
    ``1`` differ, ``1`` and ``1.0`` do not).
    """

    def __init__(
        self,
        command: str | Column,
        expected: Any = None,
        *,
        stdin: str | Column | None = None,
        cases: Sequence[Any] | Column | None = None,
        mode: MatchMode = "exact",
        strip: bool = True,
        require_exit_zero: bool = True,
        cwd: str = "/work",
        timeout_seconds: float = 10.0,
        name: str | None = None,
    ) -> None:
        if mode not in ("exact", "regex", "json"):
            raise ConfigError(f"OutputMatch: mode must be 'exact', 'regex' or 'json', not {mode!r}")
        if (expected is None) == (cases is None):
            raise ConfigError("OutputMatch: give either expected (one check) or cases (several)")
        if cases is not None and stdin is not None:
            raise ConfigError("OutputMatch: with cases, each case carries its own stdin")
        self.command = command
        self.expected = expected
        self.stdin = stdin
        self.cases = cases
        self.mode = mode
        self.strip = strip
        self.require_exit_zero = require_exit_zero
        self.cwd = cwd
        self.timeout_seconds = _positive("OutputMatch", "timeout_seconds", timeout_seconds)
        self.name = check_name(name, "output_match")

    def _cases(self, sample: Sample) -> list[tuple[str | None, Any]]:
        if self.cases is None:
            stdin = resolve(self.stdin, sample, "stdin")
            return [(_stdin(stdin, "stdin"), resolve(self.expected, sample, "expected"))]
        cases = resolve(self.cases, sample, "cases")
        if isinstance(cases, str | bytes) or not isinstance(cases, Sequence) or not cases:
            raise ConfigError("OutputMatch: cases must be a non-empty list")
        parsed = []
        for number, case in enumerate(cases):
            if isinstance(case, Mapping):
                stdin = case.get("stdin", case.get("input"))
                if "expected" in case:
                    expected = case["expected"]
                elif "output" in case:
                    expected = case["output"]
                else:
                    raise ConfigError(f"OutputMatch: case {number} has no 'expected' (or 'output')")
            elif isinstance(case, Sequence) and not isinstance(case, str) and len(case) == 2:
                stdin, expected = case
            else:
                raise ConfigError(
                    f"OutputMatch: case {number} must be a dict or a (stdin, expected) pair"
                )
            parsed.append((_stdin(stdin, f"case {number} stdin"), expected))
        return parsed

    async def score(self, sample: Sample) -> RewardResult:
        sandbox = sample.need_sandbox(self)
        command = resolve(self.command, sample, "command")
        cases = self._cases(sample)
        if self.mode == "regex":
            patterns = [_pattern(expected) for _, expected in cases]
        results = []
        for number, (stdin, expected) in enumerate(cases):
            try:
                run = await sandbox.commands.run(
                    command, cwd=self.cwd, stdin=stdin, timeout_seconds=self.timeout_seconds
                )
            except CommandError as exc:  # what the program left behind holds the pids limit
                return RewardResult.failure(f"the command could not start: {exc}", self.name)
            if run.timed_out:
                reason: str | None = f"timed out after {self.timeout_seconds:g} s"
            elif self.require_exit_zero and run.exit_code != 0:
                reason = f"exit code {run.exit_code}"
            elif run.truncated:
                reason = "the output went past the sandbox's cap"
            else:
                target = patterns[number] if self.mode == "regex" else expected
                reason = self._compare(run.stdout, target)
            entry: dict[str, Any] = {"case": number, "passed": reason is None}
            if reason is not None:
                entry["reason"] = reason
                entry["stdout"] = clip_detail(run.stdout, 300)
                if run.stderr.strip():
                    entry["stderr"] = clip_detail(run.stderr, 300)
            results.append(entry)
        passed = sum(1 for entry in results if entry["passed"])
        score = passed / len(cases)
        return RewardResult(
            score=score,
            components={self.name: score},
            details={"passed": passed, "cases": len(cases), "results": results[:20]},
        )

    def _compare(self, stdout: str, expected: Any) -> str | None:
        """None if ``stdout`` is what is expected, else why not."""
        if len(stdout) > _MATCH_CHARS:
            return "the output is too long to compare"
        if self.mode == "json":
            try:
                value = json.loads(stdout)
            except (ValueError, RecursionError):
                return "the output is not JSON"
            return None if json_equal(value, expected) else "a different JSON value"
        text = _trim(stdout) if self.strip else stdout
        if self.mode == "regex":
            if len(text) > _REGEX_CHARS:
                return "the output is too long to match a pattern against"
            return None if expected.fullmatch(text) else "the output does not match the pattern"
        if not isinstance(expected, str):
            raise ConfigError(
                f"OutputMatch: in exact mode expected is text, not {type(expected).__name__}"
            )
        wanted = _trim(expected) if self.strip else expected
        return None if text == wanted else "a different output"


def _stdin(value: Any, label: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ConfigError(f"OutputMatch: {label} must be text, not {type(value).__name__}")


def _pattern(expected: Any) -> re.Pattern[str]:
    if isinstance(expected, re.Pattern):
        return expected
    if not isinstance(expected, str):
        raise ConfigError(f"OutputMatch: a regex is text, not {type(expected).__name__}")
    try:
        return re.compile(expected, re.DOTALL)
    except re.error as exc:
        raise ConfigError(f"OutputMatch: invalid regex {expected!r}: {exc}") from exc


def _trim(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip()


def json_equal(left: Any, right: Any, _depth: int = 0) -> bool:
    """JSON equality: numbers by value, but a bool is not a number; lists and tuples alike."""
    if _depth > 200:
        return False
    if isinstance(left, bool) or isinstance(right, bool):
        return type(left) is bool and type(right) is bool and left == right
    if isinstance(left, int | float) and isinstance(right, int | float):
        return left == right
    if isinstance(left, str) and isinstance(right, str):
        return left == right
    if left is None or right is None:
        return left is None and right is None
    if isinstance(left, list | tuple) and isinstance(right, list | tuple):
        return len(left) == len(right) and all(
            json_equal(a, b, _depth + 1) for a, b in zip(left, right, strict=True)
        )
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(
            json_equal(left[key], right[key], _depth + 1) for key in left
        )
    return False


exit_code = ExitCode
output_match = OutputMatch
