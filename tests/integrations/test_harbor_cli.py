"""Harbor's own CLI runs its trials in rollbox sandboxes:
``harbor run -p TASKS -a oracle -e rollbox.integrations.harbor:RollboxEnvironment``.

Harbor needs Python >= 3.12, so it runs from a venv of its own (``ROLLBOX_HARBOR_PYTHON``, as
``.ci/run`` builds it; the test fails in CI without one and is skipped elsewhere). The rewards
asserted are the ones Harbor itself recorded in each trial's ``result.json``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollbox.sandbox import _host
from tests.conftest import assert_no_leftovers

HARBOR_TASKS = Path(__file__).resolve().parent / "harbor_tasks"
ENVIRONMENT = "rollbox.integrations.harbor:RollboxEnvironment"
DEFAULT_PYTHON = "/work/venv312/bin/python"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def harbor_python() -> str:
    """The interpreter with harbor and rollbox; skip (fail in CI) if there is none."""
    python = os.environ.get("ROLLBOX_HARBOR_PYTHON", DEFAULT_PYTHON)
    problem = None
    if not Path(python).is_file():
        problem = f"{python} does not exist"
    else:
        probe = subprocess.run(
            [python, "-c", "import harbor, rollbox.integrations.harbor"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if probe.returncode != 0:
            problem = f"{python} cannot import harbor and rollbox: {probe.stderr.strip()[-500:]}"
    if problem is None:
        return python
    reason = (
        f"the Harbor tests need a Python 3.12 venv with harbor and rollbox: {problem}. Build it "
        "as .ci/run does, or point ROLLBOX_HARBOR_PYTHON at one"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass
class Job:
    returncode: int
    output: str
    trials: dict[str, dict[str, Any]]  # task name -> Harbor's result.json of its trial
    sandbox_ids: set[str]

    def reward(self, task: str) -> dict[str, Any] | None:
        trial = self.trials[task]
        assert trial["exception_info"] is None, trial["exception_info"]
        return (trial["verifier_result"] or {}).get("rewards")


def harbor_run(
    python: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> Job:
    """Run ``harbor run ARGS -e RollboxEnvironment`` and read what Harbor recorded; then check
    that nothing of the sandboxes it made is left."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    jobs = tmp_path / "jobs"
    command = [str(Path(python).parent / "harbor"), "run", *args, "-e", ENVIRONMENT]
    command += ["-o", str(jobs), "--job-name", "job", "-y", "-q", "-n", "2"]
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(env or {})},
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    trials = {}
    sandbox_ids: set[str] = set()
    for result in sorted(jobs.glob("job/*/result.json")):
        trial = json.loads(result.read_text())
        trials[trial["task_name"]] = trial
        log = result.parent / "trial.log"
        sandbox_ids |= set(re.findall(r"rollbox sandbox (sb-[0-9a-f]+)", log.read_text()))
    assert len(sandbox_ids) == len(trials), (sandbox_ids, output)
    assert_no_leftovers(sandbox_ids)
    records = _host.state_dir() / "sandboxes"
    for record in records.glob("*.json") if records.is_dir() else ():
        try:
            owner = json.loads(record.read_text()).get("owner_pid")
        except (OSError, ValueError):
            continue
        assert owner != process.pid, f"harbor left {record.name} behind"
    return Job(process.returncode, output, trials, sandbox_ids)


def test_oracle_and_nop_trials_on_rollbox(harbor_python: str, tmp_path: Path) -> None:
    for agent, reward in (("oracle", 1.0), ("nop", 0.0)):
        job = harbor_run(
            harbor_python,
            tmp_path / agent,
            "-p", str(HARBOR_TASKS), "-x", "python-bugfix", "-a", agent,
        )  # fmt: skip
        assert job.returncode == 0, job.output
        assert set(job.trials) == {"shell-count", "rollbox-tests/hidden-slug"}, job.output
        for task in job.trials:
            assert job.reward(task) == {"reward": reward}, (agent, task, job.trials[task])
        trial_dir = tmp_path / agent / "jobs" / "job"
        # Harbor downloaded the verifier's and the agent's logs from the sandbox
        [stdout] = trial_dir.glob("shell-count__*/verifier/test-stdout.txt")
        assert ("count.txt is missing" in stdout.read_text()) == (agent == "nop")
        if agent == "oracle":
            assert list(trial_dir.glob("shell-count__*/agent/oracle.txt"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_python_bugfix_trials_on_rollbox(harbor_python: str, tmp_path: Path) -> None:
    for agent, rewards in (
        ("oracle", {"reward": 1, "tests_passed": 4}),
        ("nop", {"reward": 0, "tests_passed": 3}),
    ):
        job = harbor_run(
            harbor_python,
            tmp_path / agent,
            "-p", str(HARBOR_TASKS / "python-bugfix"), "-a", agent,
            timeout=840,
        )  # fmt: skip
        assert job.returncode == 0, job.output
        assert job.reward("python-bugfix") == rewards, job.trials


CHEATER = textwrap.dedent(
    """\
    from harbor.agents.base import BaseAgent


    class Cheater(BaseAgent):
        @staticmethod
        def name():
            return "rollbox-test-cheater"

        def version(self):
            return "1"

        async def setup(self, environment):
            pass

        async def run(self, instruction, environment, context):
            searches = [
                "grep -rl --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev "
                "ROLLBOX-HIDDEN-TEST-MARKER / 2>/dev/null",
                "find / -xdev -name 'check_slug*' 2>/dev/null",
                "ls -A /tests /solution",
            ]
            found = [(await environment.exec(c)).stdout or "" for c in searches]
            (self.logs_dir / "found.json").write_text(__import__("json").dumps(found))
            slug = (
                "import re\\n\\ndef slugify(text):\\n"
                "    return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')\\n"
            )
            await environment.exec(
                f"cat > /tests/slug.py <<'EOF'\\n{slug}EOF\\n"
                "echo 'raise SystemExit(0)' > /tests/check_slug.py; "
                "(setsid sh -c 'while :; do echo 1 > /logs/verifier/reward.txt; "
                "echo \\"{\\\\\\"reward\\\\\\": 1}\\" > /logs/verifier/reward.json; sleep 0.01; done' "
                ">/dev/null 2>&1 &)"
            )
    """
)


def test_hidden_tests_and_leftover_processes_under_harbor(
    harbor_python: str, tmp_path: Path
) -> None:
    """A Harbor agent that searches for the tests, plants a right answer where only the tests
    would find it, and leaves a process writing reward files: it finds nothing, and scores 0."""
    (tmp_path / "rollbox_test_cheater.py").write_text(CHEATER)
    job = harbor_run(
        harbor_python,
        tmp_path,
        "-p", str(HARBOR_TASKS / "hidden-tests"), "-a", "rollbox_test_cheater:Cheater",
        env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert job.returncode == 0, job.output
    assert job.reward("rollbox-tests/hidden-slug") == {"reward": 0.0}, job.trials
    [trial] = (tmp_path / "jobs" / "job").glob("hidden-tests__*/")
    files = sorted(str(p.relative_to(trial)) for p in trial.rglob("*"))
    assert json.loads((trial / "agent" / "found.json").read_text()) == [
        "",
        "",
        "/solution:\n\n/tests:\n",
    ], files
    assert "verifier/test-stdout.txt" in files, (files, job.output)
    assert "No module named 'slug'" in (trial / "verifier" / "test-stdout.txt").read_text()


def test_a_task_rollbox_cannot_run_fails_with_the_reason(
    harbor_python: str, tmp_path: Path
) -> None:
    task = tmp_path / "tasks" / "alpine-task"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text('[environment]\nnetwork_mode = "no-network"\n')
    (task / "instruction.md").write_text("Do nothing.\n")
    (task / "environment" / "Dockerfile").write_text("FROM alpine:3.19\n")
    (task / "tests" / "test.sh").write_text("#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")
    harbor = str(Path(harbor_python).parent / "harbor")
    command = [harbor, "run", "-p", str(task), "-a", "nop", "-e", ENVIRONMENT]
    command += ["-o", str(tmp_path / "jobs"), "--job-name", "job", "-y", "-q"]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "COLUMNS": "400"},
    )
    # Harbor builds the environment before the trial starts: the job stops with rollbox's reason
    assert done.returncode != 0
    output = " ".join((done.stdout + done.stderr).replace("\u2502", " ").split())
    assert "ConfigError" in output
    assert "FROM alpine:3.19: the local backend makes python:*, debian:* and ubuntu:*" in output
    assert "provider='docker'" in output


@pytest.mark.docker
@pytest.mark.timeout(600)
async def test_trials_on_rollboxs_docker_backend(harbor_python: str, tmp_path: Path) -> None:
    """``--ek provider=docker``: the task's FROM image as it is, on the Docker Engine."""
    import shutil

    from rollbox.sandbox.templates import Template, host_python_fingerprint
    from tests.sandbox._docker import make_docker_provider

    docker = make_docker_provider()
    try:
        # no registry here: the task's image is rollbox's python base, imported on first use
        await docker.build_template(Template(name="harbor-test-base", base="python"))
    finally:
        await docker.close()
    task = tmp_path / "shell-count"
    shutil.copytree(HARBOR_TASKS / "shell-count", task)
    dockerfile = task / "environment" / "Dockerfile"
    image = f"rollbox/python:{host_python_fingerprint()}"
    dockerfile.write_text(dockerfile.read_text().replace("FROM python:3.11-slim", f"FROM {image}"))
    for agent, reward in (("oracle", 1.0), ("nop", 0.0)):
        job = harbor_run(
            harbor_python,
            tmp_path / agent,
            "-p", str(task), "-a", agent, "--ek", "provider=docker",
        )  # fmt: skip
        assert job.returncode == 0, job.output
        assert job.reward("shell-count") == {"reward": reward}, job.trials
        [sandbox_id] = job.sandbox_ids
        filters = json.dumps({"label": [f"rollbox.sandbox={sandbox_id}"]})
        left = docker.client.sync_call(
            "GET", "/containers/json", params={"all": "1", "filters": filters}
        ).json()
        assert not left, f"harbor left its container behind: {left}"
