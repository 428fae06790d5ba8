"""pytest_suite: hidden pytest files, scored by the fraction of tests that pass.

The verdict is pytest's own JUnit XML report, written to a random path in a directory made at
scoring time and parsed on the host. The run ignores everything the agent could plant for
pytest or Python to pick up: the hidden files go to a fresh directory after the agent's
processes are stopped; pytest runs under ``python3 -I`` (no PYTHONPATH, no user site, no
current directory on ``sys.path``) with an explicit ini file, ``--confcutdir`` at the tests and
no cache, and ``/work`` is put at the *end* of ``sys.path``, so a ``pytest.py``, ``conftest.py``,
``pytest.ini``, ``sitecustomize.py`` or ``.pth`` file in ``/work`` or ``/tmp`` is never loaded.

The hidden files are made read-only, and read back after the run: a run that changed them
scores 0.0. The limit, stated plainly: pytest runs the code under test in its own process (that is what a
test that imports the solution does). Code that deliberately rewrites pytest's internals from
inside, or returns objects whose ``__eq__`` always says yes, can fake a pass. For function-level
tasks use ``PythonTests``, which never runs the solution where the verdict is made.
"""

from __future__ import annotations

import ast
import math
import posixpath
import secrets
import shlex
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rollbox.errors import CommandError, ConfigError, SandboxFileError
from rollbox.rewards.base import Column, Reward, Sample, check_name, clip_detail, resolve
from rollbox.rewards.result import RewardResult

if TYPE_CHECKING:
    from rollbox.envs.task import TaskFile

_REPORT_LIMIT = 10 * 1024 * 1024
_RUNNER = (
    "import sys; sys.path.append(sys.argv.pop(1)); import pytest; "
    "sys.exit(pytest.main(sys.argv[1:]))"
)


class PytestSuite(Reward):
    """Run hidden pytest files against the sandbox; the score is the fraction of tests passed.

    Args:
        files: the hidden test files, ``{relative path: content}`` (a ``Column`` too). A
            ``conftest.py`` among them is honoured.
        pythonpath: appended to ``sys.path`` so that the tests can import the solution.
        args: extra pytest arguments (e.g. ``["-x"]``).
        timeout_seconds: time for the whole run; a run that times out scores 0.0.
        python: the sandbox's Python, which must have pytest installed.

    A skipped or xfailed test counts as not passed (otherwise code that skips the tests it
    fails would gain). The denominator is never below the number of test functions found in
    the hidden files by parsing them on the host, so tests that vanish from the report count
    as failed.
    """

    def __init__(
        self,
        files: Mapping[str, str | bytes | TaskFile] | Column,
        *,
        pythonpath: str = "/work",
        args: tuple[str, ...] | list[str] = (),
        cwd: str = "/work",
        timeout_seconds: float = 300.0,
        python: str = "python3",
        name: str | None = None,
    ) -> None:
        if not (
            isinstance(timeout_seconds, int | float)
            and math.isfinite(timeout_seconds)
            and timeout_seconds > 0
        ):
            raise ConfigError(
                f"PytestSuite: timeout_seconds must be positive, not {timeout_seconds!r}"
            )
        if isinstance(args, str):
            raise ConfigError("PytestSuite: args is a list of arguments, not one string")
        self.files = files
        self.pythonpath = pythonpath
        self.args = tuple(args)
        self.cwd = cwd
        self.timeout_seconds = float(timeout_seconds)
        self.python = python
        self.name = check_name(name, "pytest")

    async def score(self, sample: Sample) -> RewardResult:
        sandbox = sample.need_sandbox(self)
        files = _test_files(resolve(self.files, sample, "files"))
        expected = sum(_count_tests(path, content) for path, content in files.items())
        token = secrets.token_hex(8)
        tests_dir = f"/tmp/.rollbox-pytest-{token}"
        report = f"/tmp/.rollbox-report-{token}/report.xml"
        try:
            for path, content in files.items():
                await sandbox.files.write(posixpath.join(tests_dir, path), content)
            await sandbox.files.write(f"{tests_dir}/.rollbox-pytest.ini", "[pytest]\n")
        except SandboxFileError as exc:  # e.g. the agent filled /tmp
            return RewardResult.failure(f"could not upload the tests: {exc}", self.name)
        argv = [
            self.python, "-I", "-c", _RUNNER, self.pythonpath,
            "-c", f"{tests_dir}/.rollbox-pytest.ini", "--rootdir", tests_dir,
            "--confcutdir", tests_dir, "-p", "no:cacheprovider", "-q", "-rN",
            "--junitxml", report, *self.args, tests_dir,
        ]  # fmt: skip
        command = (
            f"mkdir -p {posixpath.dirname(report)} && chmod -R a-w {tests_dir} && "
            + " ".join(shlex.quote(part) for part in argv)
        )
        try:
            run = await sandbox.commands.run(
                command,
                cwd=self.cwd,
                timeout_seconds=self.timeout_seconds,
                env={"PYTHONDONTWRITEBYTECODE": "1", "PYTEST_ADDOPTS": ""},
            )
        except CommandError as exc:
            return RewardResult.failure(f"pytest could not start: {exc}", self.name)
        details: dict[str, Any] = {
            "exit_code": run.exit_code,
            "timed_out": run.timed_out,
            "stdout": clip_detail(run.stdout),
        }
        if run.stderr.strip():
            details["stderr"] = clip_detail(run.stderr)
        if run.timed_out:
            return RewardResult.failure(
                f"pytest timed out after {self.timeout_seconds:g} s", self.name, **details
            )
        for path, content in files.items():  # a pass earned by rewriting the tests is no pass
            written = content.encode() if isinstance(content, str) else content
            now = await _read_capped(sandbox, posixpath.join(tests_dir, path), len(written) + 1)
            if now != written:
                return RewardResult.failure(
                    f"the test file {path} was modified during the run", self.name, **details
                )
        xml = await _read_report(sandbox, report)
        if xml is None:
            return RewardResult.failure(
                "pytest wrote no report (it crashed or was stopped)", self.name, **details
            )
        cases = _parse_junit(xml)
        if cases is None:
            return RewardResult.failure(
                "pytest's report is not valid JUnit XML", self.name, **details
            )
        passed = [case for case, outcome in cases if outcome == "passed"]
        failed = [
            {"test": case, "outcome": outcome} for case, outcome in cases if outcome != "passed"
        ]
        total = max(len(cases), expected)
        if total == 0:
            return RewardResult.failure("no tests were collected", self.name, **details)
        score = len(passed) / total
        details.update(
            fraction=score,
            tests=total,
            passed=passed[:200],
            failed=failed[:200],
            missing_from_report=max(0, expected - len(cases)),
        )
        return RewardResult(score=score, components={self.name: score}, details=details)


def _test_files(files: Any) -> dict[str, str | bytes]:
    if not isinstance(files, Mapping) or not files:
        raise ConfigError("PytestSuite: files must be a non-empty {relative path: content} mapping")
    parsed: dict[str, str | bytes] = {}
    for path, content in files.items():
        normal = posixpath.normpath(path) if isinstance(path, str) else ""
        if not normal or normal.startswith(("/", "..")) or "\0" in normal:
            raise ConfigError(
                f"PytestSuite: test file path {path!r} must be relative, inside the tests"
            )
        content = getattr(content, "content", content)  # a TaskFile
        if not isinstance(content, str | bytes):
            raise ConfigError(f"PytestSuite: the content of {path!r} must be str or bytes")
        parsed[normal] = content
    return parsed


def _count_tests(path: str, content: str | bytes) -> int:
    """Test functions in a test file, by pytest's default rules (a parametrized one counts 1)."""
    name = posixpath.basename(path)
    if not (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))):
        return 0
    try:
        module = ast.parse(content)
    except SyntaxError:
        return 0  # pytest reports the collection error itself
    count = 0
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            count += 1
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            count += sum(
                1
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                and item.name.startswith("test")
            )
    return count


async def _read_capped(sandbox: Any, path: str, limit: int) -> bytes | None:
    """A regular file's content if it is at most ``limit`` bytes; None otherwise."""
    directory, name = posixpath.split(path)
    try:
        entries = await sandbox.files.list(directory)
    except SandboxFileError:
        return None
    entry = next((e for e in entries if e.name == name and e.type == "file"), None)
    if entry is None or entry.size > limit:
        return None
    try:
        return await sandbox.files.read(path)
    except SandboxFileError:
        return None


async def _read_report(sandbox: Any, path: str) -> str | None:
    data = await _read_capped(sandbox, path, _REPORT_LIMIT)
    return None if data is None else data.decode("utf-8", errors="replace")


def _parse_junit(xml: str) -> list[tuple[str, str]] | None:
    """``(test id, outcome)`` per test case; None if this is not a report pytest wrote."""
    if "<!DOCTYPE" in xml or "<!ENTITY" in xml:  # pytest writes neither; entity bombs do
        return None
    try:
        root = ElementTree.fromstring(xml)
    except ElementTree.ParseError:
        return None
    cases = []
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        if "failure" in tags or "error" in tags:
            outcome = "failed"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        cases.append((test_id, outcome))
    return cases


pytest_suite = PytestSuite
