"""pytest_suite: hidden pytest files; what the agent plants for pytest or Python is ignored."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from rollbox import AsyncSandbox
from rollbox.errors import ConfigError
from rollbox.rewards import PytestSuite, Sample

TESTS = {
    "test_calc.py": (
        "from calc import add\n\n"
        "def test_small():\n    assert add(1, 2) == 3\n\n"
        "def test_negative():\n    assert add(-1, -1) == -2\n\n"
        "class TestMore:\n"
        "    def test_zero(self):\n        assert add(0, 0) == 0\n\n"
        "    def test_big(self):\n        assert add(10**20, 1) == 10**20 + 1\n"
    ),
}
SUITE = PytestSuite(TESTS)
RIGHT = "def add(a, b):\n    return a + b\n"


@pytest.fixture
async def box(provider: Any) -> AsyncIterator[AsyncSandbox]:
    async with await AsyncSandbox.create(provider=provider) as sandbox:
        probe = await sandbox.commands.run("python3 -c 'import pytest'")
        if not probe.ok:
            pytest.skip("the sandbox's python3 has no pytest: apt-get install python3-pytest")
        yield sandbox


async def _score(sandbox: AsyncSandbox, files: dict[str, str], reward: PytestSuite = SUITE) -> Any:
    for path, content in files.items():
        await sandbox.files.write(path, content)
    return await reward.score(Sample(sandbox=sandbox))


async def test_the_score_is_the_fraction_passed(box: AsyncSandbox) -> None:
    result = await _score(box, {"/work/calc.py": RIGHT})
    assert result.score == 1.0 and result.details["tests"] == 4, result.details
    assert "test_calc.TestMore::test_big" in result.details["passed"]
    half = await _score(box, {"/work/calc.py": "def add(a, b):\n    return abs(a) + abs(b)\n"})
    assert half.score == 0.75
    assert half.details["failed"] == [{"test": "test_calc::test_negative", "outcome": "failed"}]


async def test_a_broken_solution_scores_zero(box: AsyncSandbox) -> None:
    result = await _score(box, {"/work/calc.py": "def add(a, b):\n    return a +\n"})
    assert result.score == 0.0 and result.details["tests"] == 4
    # the collection error is one entry in the report; the tests it hid count as failed
    assert result.details["missing_from_report"] == 3


PLANTED = {
    "a conftest.py that passes everything": {
        "/work/conftest.py": "import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
        "    report = outcome.get_result(); report.outcome = 'passed'\n",
        "/tmp/conftest.py": "raise SystemExit(0)\n",
    },
    "ini files with addopts": {
        "/work/pytest.ini": "[pytest]\naddopts = -p no:junitxml --co\n",
        "/tmp/pytest.ini": "[pytest]\naddopts = --co\n",
        "/work/setup.cfg": "[tool:pytest]\naddopts = --co\n",
        "/work/tox.ini": "[pytest]\naddopts = --co\n",
    },
    "a pytest.py and json.py that shadow the real ones": {
        "/work/pytest.py": "import sys\nprint('fake pytest'); sys.exit(0)\n",
        "/work/xml/__init__.py": "raise SystemExit(0)\n",
        "/work/_pytest/__init__.py": "raise SystemExit(0)\n",
    },
    "sitecustomize, usercustomize and a .pth file": {
        "/work/sitecustomize.py": "import os\nos._exit(0)\n",
        "/work/usercustomize.py": "import os\nos._exit(0)\n",
        "/work/evil.pth": "import os; os._exit(0)\n",
    },
    "edited copies of the tests": {
        "/work/test_calc.py": "def test_small():\n    pass\n",
        "/tmp/test_calc.py": "def test_small():\n    pass\n",
    },
}


@pytest.mark.parametrize("attack", sorted(PLANTED))
async def test_planted_files_are_ignored(box: AsyncSandbox, attack: str) -> None:
    wrong = {"/work/calc.py": "def add(a, b):\n    return 0\n"}
    result = await _score(box, {**PLANTED[attack], **wrong})
    assert result.score == 0.25, (attack, result.details)  # only add(0, 0) == 0 holds


async def test_exiting_early_with_status_0_scores_zero(box: AsyncSandbox) -> None:
    result = await _score(box, {"/work/calc.py": "import os\nos._exit(0)\n"})
    assert result.score == 0.0
    assert result.details["error"].startswith("pytest wrote no report")


async def test_skipping_the_tests_is_not_passing_them(box: AsyncSandbox) -> None:
    program = "import pytest\ndef add(a, b):\n    pytest.skip('later')\n"
    result = await _score(box, {"/work/calc.py": program})
    assert result.score == 0.0 and len(result.details["failed"]) == 4


async def test_a_solution_that_deselects_tests_does_not_shrink_the_denominator(
    box: AsyncSandbox,
) -> None:
    # at import, drop every test but the one it passes from the session
    program = (
        "import gc, _pytest.main\n"
        "def add(a, b):\n    return 0\n"
        "for obj in gc.get_objects():\n"
        "    if isinstance(obj, _pytest.main.Session):\n"
        "        obj.config.option.deselect = ['x']\n"
        "        obj.config.option.keyword = 'zero'\n"
    )
    result = await _score(box, {"/work/calc.py": program})
    assert result.score <= 0.25, result.details


SPLIT = PytestSuite(
    {
        "test_a.py": "import calc\n\ndef test_a():\n    assert calc.add(1, 1) == 2\n",
        "test_b.py": "from calc import add\n\ndef test_b1():\n    assert add(2, 2) == 4\n\n"
        "def test_b2():\n    assert add(3, 3) == 6\n",
    }
)
# Imported while test_a.py is collected, it rewrites test_b.py before pytest reads it.
REWRITE = """\
import glob, os
for path in glob.glob("/tmp/.rollbox-pytest-*/test_b.py"):
    try:
        {prepare}
        open(path, "w").write("def test_b1():\\n    pass\\n\\ndef test_b2():\\n    pass\\n")
    except OSError as exc:
        open("/work/attempt.txt", "w").write("could not rewrite: %s" % exc)
def add(a, b):
    return 0
"""


async def test_the_tests_are_a_read_only_copy(box: AsyncSandbox) -> None:
    result = await _score(box, {"/work/calc.py": REWRITE.format(prepare="pass")}, SPLIT)
    assert result.score == 0.0, result.details
    attempt = await box.files.read_text("/work/attempt.txt")  # it tried, and the copy held
    assert attempt.startswith("could not rewrite: [Errno 13] Permission denied")


async def test_tests_rewritten_during_the_run_score_zero(box: AsyncSandbox) -> None:
    program = REWRITE.format(prepare="os.chmod(path, 0o644)")  # the owner can undo read-only
    result = await _score(box, {"/work/calc.py": program}, SPLIT)
    assert result.score == 0.0
    assert result.details["error"] == "the test file test_b.py was modified during the run"


def test_bad_files_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="timeout_seconds"):
        PytestSuite(TESTS, timeout_seconds=-1)


async def test_escaping_paths_are_a_config_error(box: AsyncSandbox) -> None:
    with pytest.raises(ConfigError, match="must be relative"):
        await _score(box, {}, PytestSuite({"../x/test_a.py": ""}))
