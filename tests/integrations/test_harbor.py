"""Harbor task directories as rollbox tasks: loading, the environment's translation, oracle and
nop runs through rollbox, hidden tests, and ``rollbox run --harbor``.

The task directories in ``harbor_tasks/`` are real Harbor tasks (``test_harbor_cli.py`` runs them
with Harbor's own CLI): ``shell-count`` (a shell task), ``hidden-tests`` (tests the agent must
never see) and ``python-bugfix`` (pytest in a python:3.11 image, which the local backend makes
from Debian with pip: slow the first time, so its tests are marked slow).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollbox.envs import AsyncSandboxEnv
from rollbox.envs.harbor import (
    DEFAULT_LIMITS,
    HarborDataset,
    HarborVerifier,
    harbor_agent,
    load_harbor_tasks,
    read_harbor_task,
    read_harbor_tasks,
    translate_dockerfile,
)
from rollbox.errors import ConfigError, TaskSetupError
from rollbox.runner import run_rollouts
from rollbox.sandbox.models import NetworkConfig
from rollbox.sandbox.templates import AptStep, CopyStep, EnvStep, RunStep, WorkdirStep

HARBOR_TASKS = Path(__file__).resolve().parent / "harbor_tasks"
CHEAP = ["shell-count", "hidden-tests"]  # the python base: no debootstrap, no network
HIDDEN_MARKER = "ROLLBOX-HIDDEN-TEST-MARKER"
SOLUTION_MARKER = "ROLLBOX-SOLUTION-MARKER"

pytestmark = pytest.mark.timeout(120)

PASSING_TEST = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"


def write_task(
    root: Path,
    *,
    toml: str = '[environment]\nnetwork_mode = "no-network"\n',
    dockerfile: str | None = "FROM python:3.11-slim\nWORKDIR /app\n",
    instruction: str | None = "Do the thing.\n",
    test_sh: str | None = PASSING_TEST,
    solve_sh: str | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """A Harbor task directory under ``root``; ``None`` leaves a file out."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "task.toml").write_text(toml)
    contents = {
        "instruction.md": instruction,
        "environment/Dockerfile": dockerfile,
        "tests/test.sh": test_sh,
        "solution/solve.sh": solve_sh,
        **(files or {}),
    }
    for name, text in contents.items():
        if text is not None:
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if name.endswith(".sh"):
                path.chmod(0o755)
    return root


# -- loading ----------------------------------------------------------------------------------------


def test_reads_the_test_task_set() -> None:
    tasks = {t.path.name: t for t in read_harbor_tasks(HARBOR_TASKS)}
    assert sorted(tasks) == ["hidden-tests", "python-bugfix", "shell-count"]

    shell = tasks["shell-count"]
    assert shell.id == "shell-count"
    # Harbor drops the leading canary comment: the agent never reads it
    assert shell.instruction.startswith("The file `/app/words.txt`")
    assert "canary" not in shell.instruction
    assert shell.limits == DEFAULT_LIMITS.model_copy(update={"cpus": 1.0, "memory_mb": 512})
    assert shell.network == NetworkConfig()  # network_mode = "no-network"
    assert shell.agent_timeout_seconds == 120.0
    assert shell.verifier_timeout_seconds == 60.0
    assert shell.workdir == "/app"
    assert set(shell.tests) == {"test.sh"} and set(shell.solution) == {"solve.sh"}

    hidden = tasks["hidden-tests"]
    assert hidden.id == "rollbox-tests/hidden-slug"  # [task].name wins over the directory
    assert HIDDEN_MARKER in hidden.tests["check_slug.py"].content

    bugfix = tasks["python-bugfix"]
    template = bugfix.template("local")
    # pip in a python:* image: Debian with python3-pip stands in for it locally
    assert template.base == "debian:bookworm"
    assert any(isinstance(s, AptStep) and "python3-pip" in s.apt for s in template.steps)
    assert RunStep(run="pip install --no-cache-dir pytest==8.3.4") in template.steps
    # on Docker the image is used as it is
    assert bugfix.template("docker").base == "python:3.11-slim"


def test_loads_rollbox_tasks_whose_templates_are_built() -> None:
    from rollbox.sandbox.templates import find_local_template

    [task] = load_harbor_tasks(HARBOR_TASKS / "shell-count")
    assert task.id == "shell-count"
    assert task.template.startswith("tpl-")
    assert find_local_template(task.template) is not None
    assert isinstance(task.verifier, HarborVerifier)
    assert task.episode_timeout_seconds == 120.0  # [agent].timeout_sec is the time budget
    assert task.limits.memory_mb == 512 and task.limits.cpus == 1.0
    assert task.metadata["difficulty"] == "easy"
    assert task.metadata["harbor"]["workdir"] == "/app"
    # the hidden tests are nowhere in the Task's sandbox-bound fields
    assert not task.files and not task.setup


def test_harbor_fields_map_to_limits_network_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLBOX_TEST_TOKEN", "s3cret")
    monkeypatch.delenv("ROLLBOX_TEST_UNSET", raising=False)
    task = read_harbor_task(
        write_task(
            tmp_path / "t",
            toml=textwrap.dedent(
                """\
                version = "1.0"
                [agent]
                timeout_sec = 30
                [verifier]
                timeout_sec = 45
                env = { JUDGE_KEY = "${ROLLBOX_TEST_TOKEN}" }
                [environment]
                memory = "2G"
                storage_mb = 3000
                cpus = 0.5
                network_mode = "allowlist"
                allowed_hosts = ["10.1.2.3", "192.168.0.0/16"]
                some_future_field = "ignored, as Harbor ignores it"
                [environment.env]
                GREETING = "hello"
                MODE = "${ROLLBOX_TEST_UNSET:-fallback}"
                """
            ),
        )
    )
    assert task.limits == DEFAULT_LIMITS.model_copy(
        update={"memory_mb": 2048, "disk_mb": 3000, "cpus": 0.5}
    )
    assert task.network == NetworkConfig(allow_out=("10.1.2.3", "192.168.0.0/16"))
    assert task.env_vars == {"GREETING": "hello", "MODE": "fallback"}
    assert task.verifier_env == {"JUDGE_KEY": "s3cret"}  # the verifier's only, never the agent's
    assert task.agent_timeout_seconds == 30 and task.verifier_timeout_seconds == 45

    public = read_harbor_task(write_task(tmp_path / "public", toml=""))
    assert public.network == NetworkConfig(allow_out=("0.0.0.0/0",))  # Harbor's default
    offline = read_harbor_task(
        write_task(tmp_path / "offline", toml="[environment]\nallow_internet = false\n")
    )
    assert offline.network == NetworkConfig()


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[verifier\ntimeout_sec = 1\n", r"task\.toml: not valid TOML"),
        ('[environment]\nmemory_mb = "lots"\n', r"task\.toml: environment\.memory_mb"),
        ("[verifier]\ntimeout_sec = -5\n", r"verifier\.timeout_sec"),
        ('[environment]\nnetwork_mode = "intranet"\n', r"environment\.network_mode"),
        ('[environment]\nmemory = "lots"\n', r"environment\.memory: 'lots' is not a size"),
        ("[environment]\ngpus = 1\n", r"environment\.gpus: gpus = 1: rollbox sandboxes have no"),
        ('[environment]\nos = "windows"\n', r"environment\.os: .*Linux"),
        ('[[steps]]\nname = "one"\n', r"steps: multi-step tasks"),
        ('[verifier]\nenvironment_mode = "separate"\n', r"separate verifier environment"),
        (
            '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n',
            r"'pypi\.org': rollbox allow-lists hold IPv4 addresses and CIDRs",
        ),
        (
            '[environment]\nnetwork_mode = "no-network"\n[agent]\nnetwork_mode = "public"\n',
            r"agent\.network_mode = 'public' differs .* one network policy",
        ),
        (
            '[environment.env]\nTOKEN = "${ROLLBOX_TEST_UNSET_VAR}"\n',
            r"environment\.env\.TOKEN: \$\{ROLLBOX_TEST_UNSET_VAR\} is not set",
        ),
    ],
)
def test_a_bad_task_toml_is_a_clear_error(tmp_path: Path, toml: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        read_harbor_task(write_task(tmp_path / "t", toml=toml))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"instruction": None}, r"no instruction\.md"),
        ({"instruction": "\n\n"}, r"empty instruction"),
        ({"test_sh": None}, r"no tests/test\.sh"),
        ({"dockerfile": None}, r"no environment/Dockerfile and no \[environment\]\.docker_image"),
        ({"files": {"environment/docker-compose.yaml": "services: {}\n"}}, r"Docker Compose"),
        ({"files": {"tests/.harborignore": "*.bak\n"}}, r"\.harborignore is not supported"),
    ],
)
def test_a_missing_or_unsupported_file_is_a_clear_error(
    tmp_path: Path, change: dict, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        read_harbor_task(write_task(tmp_path / "t", **change))


def test_folders_without_tasks_or_with_one_name_twice_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no task\.toml here nor in any subdirectory"):
        read_harbor_tasks(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"no task\.toml"):
        read_harbor_task(tmp_path / "empty")
    same = '[task]\nname = "org/same"\n[environment]\nnetwork_mode = "no-network"\n'
    write_task(tmp_path / "set" / "a", toml=same)
    write_task(tmp_path / "set" / "b", toml=same)
    with pytest.raises(ConfigError, match="are both task 'org/same'"):
        read_harbor_tasks(tmp_path / "set")


# -- the Dockerfile ---------------------------------------------------------------------------------


def translate(tmp_path: Path, dockerfile: str, **kwargs: object) -> object:
    context = tmp_path / "environment"
    context.mkdir(parents=True, exist_ok=True)
    (context / "Dockerfile").write_text(dockerfile)
    return translate_dockerfile(context / "Dockerfile", name="t", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dockerfile", "expected"),
    [
        ("FROM python:3.11 AS build\nFROM python:3.11-slim\n", r"line 2: multi-stage builds"),
        ("FROM python:3.11-slim\nCOPY --from=build /x /y\n", r"line 2: COPY --from"),
        ("FROM python:3.11-slim\nUSER app\n", r"line 2: USER app: .*only USER root"),
        ("FROM python:3.11-slim\nONBUILD RUN true\n", r"line 2: ONBUILD is not supported"),
        ("FROM python:3.11-slim\nARG V\nRUN echo $V\n", r"line 2: ARG V has no default"),
        ("FROM alpine:3.19\n", r"line 1: FROM alpine:3\.19: .*provider='docker'"),
        ("FROM debian:potato\n", r"unknown Debian release 'potato'"),
        ("FROM python:3.11-slim\nADD https://example.com/a.tgz /opt/\n", r"line 2: ADD of a URL"),
        ("FROM python:3.11-slim\nCOPY missing.txt /app/\n", r"'missing\.txt' not found"),
        ("FROM python:3.11-slim\nCOPY ../task.toml /app/\n", r"outside environment/"),
        ("FROM python:3.11-slim\nRUN --mount=type=secret,id=k cat k\n", r"RUN --mount=type=secret"),
        ("RUN true\n", r"no FROM instruction"),
        ("WORKDIR /app\nFROM python:3.11-slim\n", r"line 1: WORKDIR before FROM"),
        ("FROM python:3.11-slim\nRUN cat <<EOF\nnever closed\n", r"heredoc EOF is never closed"),
    ],
)
def test_a_dockerfile_outside_the_subset_names_its_line(
    tmp_path: Path, dockerfile: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        translate(tmp_path, dockerfile)


def test_dockerignore_is_refused(tmp_path: Path) -> None:
    (tmp_path / "environment").mkdir()
    (tmp_path / "environment" / ".dockerignore").write_text("*.log\n")
    with pytest.raises(ConfigError, match=r"\.dockerignore is not supported"):
        translate(tmp_path, "FROM python:3.11-slim\n")


@pytest.mark.parametrize(
    ("image", "base"),
    [
        ("python:3.12-slim", "python"),
        ("debian:bookworm-slim", "debian:bookworm"),
        ("debian:12", "debian:bookworm"),
        ("docker.io/library/debian:bullseye", "debian:bullseye"),
        ("ubuntu:24.04", "debian:bookworm"),
    ],
)
def test_local_bases(tmp_path: Path, image: str, base: str) -> None:
    image_ = translate(tmp_path, f"FROM {image}\n")
    assert image_.template.base == base  # type: ignore[attr-defined]
    assert image_.notes and image in image_.notes[0]  # type: ignore[attr-defined]


def test_a_python_task_that_needs_pip_or_apt_gets_debian(tmp_path: Path) -> None:
    plain = translate(tmp_path, "FROM python:3.12-slim\n")
    assert plain.template.base == "python"  # type: ignore[attr-defined]
    # test.sh installs pytest with pip: the host's bare Python would not do
    scanned = translate(tmp_path, "FROM python:3.12-slim\n", also_scan=["pip install pytest\n"])
    assert scanned.template.base == "debian:bookworm"  # type: ignore[attr-defined]
    apt = translate(tmp_path, "FROM python:3.12-bullseye\nRUN apt-get install -y jq\n")
    assert apt.template.base == "debian:bullseye"  # type: ignore[attr-defined]


def test_translation_of_the_subset(tmp_path: Path) -> None:
    context = tmp_path / "environment"
    (context / "src").mkdir(parents=True)
    (context / "src" / "main.py").write_text("print('main')\n")
    (context / "a.cfg").write_text("a\n")
    (context / "b.cfg").write_text("b\n")
    (context / "tool").write_text("#!/bin/sh\necho tool\n")
    image = translate(
        tmp_path,
        textwrap.dedent(
            """\
            # syntax=docker/dockerfile:1
            ARG BASE=python:3.11-slim
            FROM --platform=linux/amd64 ${BASE}
            ARG APP=/srv/app
            LABEL maintainer="someone"
            ENV GREETING="hello world" \\
                TARGET=$APP/out
            ENV LEGACY legacy value
            WORKDIR $APP
            COPY src/ ./src/
            COPY *.cfg conf/
            COPY tool /usr/local/bin/tool
            EXPOSE 8080
            CMD ["python3", "src/main.py"]
            """
        ),
    )
    template = image.template  # type: ignore[attr-defined]
    steps = template.steps
    assert template.base == "python"
    assert image.workdir == "/srv/app"  # type: ignore[attr-defined]
    assert EnvStep(env={"GREETING": "hello world", "TARGET": "/srv/app/out"}) in steps
    assert EnvStep(env={"LEGACY": "legacy value"}) in steps
    assert WorkdirStep(workdir="/srv/app") in steps
    copies = [(s.src, s.to) for s in steps if isinstance(s, CopyStep)]
    assert copies == [
        (str(context / "src"), "/srv/app/src"),
        (str(context / "a.cfg"), "/srv/app/conf/a.cfg"),
        (str(context / "b.cfg"), "/srv/app/conf/b.cfg"),
        (str(context / "tool"), "/usr/local/bin/tool"),
    ]
    hand_over = steps[-1].run
    assert "chown -R 65534:65534 /logs /tests /solution /srv/app" in hand_over
    assert "chown 65534:65534 /srv" in hand_over  # an ancestor: the directory only
    assert "/usr" not in hand_over  # what the Dockerfile put in system directories stays root's
    # the same Dockerfile gives the same template: cached, built once
    again = translate(tmp_path, (context / "Dockerfile").read_text())
    assert again.template.digest == template.digest  # type: ignore[attr-defined]


async def test_translated_steps_build_and_behave(tmp_path: Path, provider: object) -> None:
    """ENV, ARG, WORKDIR, COPY (dirs, globs, heredocs), RUN heredocs, SHELL, ADD of an archive,
    VOLUME, and what the sandbox user may write, in a real sandbox."""
    import tarfile

    from rollbox import AsyncSandbox

    context = tmp_path / "environment"
    (context / "pkg").mkdir(parents=True)
    (context / "pkg" / "mod.py").write_text("VALUE = 42\n")
    (context / "data").mkdir()
    (context / "data" / "inner.txt").write_text("archived\n")
    with tarfile.open(context / "bundle.tar.gz", "w:gz") as tar:
        tar.add(context / "data" / "inner.txt", arcname="inner.txt")
    (context / "notes.md").write_text("notes\n")
    dockerfile = textwrap.dedent(
        """\
        FROM python:3.11-slim
        ARG FLAVOR=vanilla
        ENV APP_HOME=/app PYTHONDONTWRITEBYTECODE=1
        WORKDIR $APP_HOME
        COPY pkg/ pkg/
        COPY *.md docs/
        ADD bundle.tar.gz /opt/bundle/
        COPY readme.txt /usr/local/share/readme.txt
        COPY <<EOF /app/generated.txt
        made by a heredoc
        EOF
        RUN <<EOF
        echo "flavor=$FLAVOR" > /app/flavor.txt
        EOF
        RUN <<EOF
        #!/usr/bin/env python3
        open("/app/from_python.txt", "w").write("python ran this")
        EOF
        SHELL ["/bin/bash", "-c"]
        RUN [[ -n "$BASH_VERSION" ]] && echo bash > /app/shell.txt
        VOLUME /data
        """
    )
    (context / "readme.txt").write_text("system file\n")
    image = translate(tmp_path, dockerfile)
    checks = {
        "cat /app/pkg/mod.py /app/docs/notes.md": "VALUE = 42\nnotes\n",
        "cat /opt/bundle/inner.txt": "archived\n",
        "cat /app/generated.txt /app/flavor.txt": "made by a heredoc\nflavor=vanilla\n",
        "cat /app/from_python.txt; echo; cat /app/shell.txt": "python ran this\nbash\n",
        'echo "$APP_HOME $PYTHONDONTWRITEBYTECODE $FLAVOR."': "/app 1 .\n",  # ARG: build only
        # the sandbox user owns what Harbor tasks write: the workdir, /logs, /opt/bundle, /data
        "touch /app/new /app/pkg/mod.py /logs/verifier/x /opt/bundle/y /data/z && echo ok": "ok\n",
    }
    async with await AsyncSandbox.create(
        from_template=image.template,  # type: ignore[attr-defined]
        provider=provider,  # type: ignore[arg-type]
    ) as sandbox:
        for command, expected in checks.items():
            result = await sandbox.commands.run(command, cwd="/app")
            assert (result.exit_code, result.stdout) == (0, expected), (command, result)
        for denied in ("/usr/local/share/readme.txt", "/usr/bin/python3", "/etc/passwd"):
            result = await sandbox.commands.run(f"echo x >> {denied}")
            assert result.exit_code != 0, denied


# -- running tasks through rollbox ----------------------------------------------------------------


async def run(tasks: list, agent: str, provider: object) -> dict:
    rollouts = await run_rollouts(
        HarborDataset(tasks),
        harbor_agent(agent),
        provider=provider,  # type: ignore[arg-type]
        score_in_agent_sandbox=True,
        n_concurrent=2,
    )
    return {r.instance_id: r for r in rollouts}


@pytest.mark.parametrize("name", CHEAP)
async def test_oracle_scores_1_and_nop_scores_0(name: str, provider: object) -> None:
    [task] = read_harbor_tasks(HARBOR_TASKS / name)
    [oracle] = (await run([task], "oracle", provider)).values()
    assert (oracle.error, oracle.agent_exit, oracle.score) == (None, "completed", 1.0), oracle
    assert oracle.details["components"] == {"reward": 1.0}
    assert oracle.details["details"]["file"] == "reward.txt"
    [nop] = (await run([task], "nop", provider)).values()
    assert (nop.error, nop.agent_exit, nop.score, nop.resolved) == (None, "nop", 0.0, False), nop


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_python_bugfix_with_pytest(provider: object) -> None:
    """pip-installed pytest in a Debian image; reward.json with two rewards."""
    [task] = read_harbor_tasks(HARBOR_TASKS / "python-bugfix")
    [oracle] = (await run([task], "oracle", provider)).values()
    assert (oracle.error, oracle.score) == (None, 1.0), oracle
    assert oracle.details["components"] == {"reward": 1.0, "tests_passed": 4.0}
    assert oracle.details["details"]["file"] == "reward.json"
    [nop] = (await run([task], "nop", provider)).values()
    assert (nop.error, nop.score) == (None, 0.0), nop
    assert nop.details["components"]["tests_passed"] == 3.0  # the bug fails one test
    assert "assert 3 == 2.5" in nop.details["details"]["test_output"]


async def test_timeouts_from_task_toml_are_honoured(tmp_path: Path, provider: object) -> None:
    write_task(
        tmp_path / "slow-agent",
        toml='[agent]\ntimeout_sec = 1\n[environment]\nnetwork_mode = "no-network"\n',
        solve_sh="#!/bin/bash\nsleep 60\n",
    )
    write_task(
        tmp_path / "slow-tests",
        toml='[verifier]\ntimeout_sec = 1\n[environment]\nnetwork_mode = "no-network"\n',
        test_sh="#!/bin/bash\nsleep 60\necho 1 > /logs/verifier/reward.txt\n",
        solve_sh="#!/bin/bash\ntrue\n",
    )
    results = await run(read_harbor_tasks(tmp_path), "oracle", provider)
    agent = results["slow-agent"]
    assert (agent.agent_exit, agent.score, agent.error) == ("timeout", 1.0, None)  # still verified
    tests = results["slow-tests"]
    assert (tests.score, tests.error) == (0.0, None)
    assert tests.details["details"]["timed_out"] is True


async def test_the_limits_of_task_toml_hold_in_the_sandbox(
    tmp_path: Path, provider: object
) -> None:
    """memory_mb and cpus are the sandbox's: an agent that takes more memory is stopped."""
    write_task(
        tmp_path / "small",
        toml='[environment]\nnetwork_mode = "no-network"\nmemory_mb = 200\ncpus = 0.5\n',
    )
    [task] = load_harbor_tasks(tmp_path / "small")
    async with AsyncSandboxEnv(task, provider=provider) as env:  # type: ignore[arg-type]
        await env.reset()
        assert env.sandbox is not None
        assert (env.sandbox.spec.limits.memory_mb, env.sandbox.spec.limits.cpus) == (200, 0.5)
        take = "python3 -c 'x = bytearray({} * 1024 * 1024); print(len(x))'; echo exit=$?"
        observation, *_ = await env.step({"tool": "bash", "command": take.format(60)})
        assert stdout_of(observation) == f"{60 * 1024 * 1024}\nexit=0"
        observation, *_ = await env.step({"tool": "bash", "command": take.format(600)})
        assert stdout_of(observation) in ("exit=137", "exit=1"), observation  # killed, or refused
        _, reward, terminated, _, _ = await env.step({"tool": "submit"})
        assert (reward, terminated) == (1.0, True)  # the sandbox lived on to be scored


async def test_the_healthcheck_runs_before_the_agent(tmp_path: Path, provider: object) -> None:
    toml = '[environment]\nnetwork_mode = "no-network"\n[environment.healthcheck]\n'
    write_task(
        tmp_path / "healthy",
        toml=toml + 'command = "test -f /app/ready"\nretries = 2\ninterval_sec = 0\n',
        dockerfile="FROM python:3.11-slim\nWORKDIR /app\nRUN touch /app/ready\n",
        solve_sh="#!/bin/bash\ntrue\n",
    )
    write_task(
        tmp_path / "unhealthy",
        toml=toml + 'command = "echo not yet >&2; false"\nretries = 2\ninterval_sec = 0\n',
        solve_sh="#!/bin/bash\ntrue\n",
    )
    results = await run(read_harbor_tasks(tmp_path), "oracle", provider)
    assert (results["healthy"].error, results["healthy"].score) == (None, 1.0)
    assert results["unhealthy"].score is None
    assert "the healthcheck failed: not yet" in results["unhealthy"].error
    [task] = load_harbor_tasks(tmp_path / "unhealthy")
    async with AsyncSandboxEnv(task, provider=provider) as env:  # type: ignore[arg-type]
        with pytest.raises(TaskSetupError, match="exited with 1"):
            await env.reset()


async def test_a_missing_or_bad_reward_file_scores_0_with_the_reason(
    tmp_path: Path, provider: object
) -> None:
    write_task(tmp_path / "silent", test_sh="#!/bin/bash\necho no reward written\n", solve_sh="")
    write_task(
        tmp_path / "garbage",
        test_sh='#!/bin/bash\necho \'{"reward": "high"}\' > /logs/verifier/reward.json\n',
        solve_sh="",
    )
    results = await run(read_harbor_tasks(tmp_path), "nop", provider)
    assert results["silent"].score == 0.0
    assert "neither reward.json nor reward.txt" in results["silent"].details["details"]["error"]
    assert results["garbage"].score == 0.0
    assert "not a finite number" in results["garbage"].details["details"]["error"]


async def test_a_task_as_a_sandbox_env_episode(provider: object) -> None:
    """The instruction is the first observation; the agent's work is scored by test.sh."""
    [task] = load_harbor_tasks(HARBOR_TASKS / "shell-count")
    async with AsyncSandboxEnv(task, provider=provider) as env:  # type: ignore[arg-type]
        observation, info = await env.reset()
        assert observation == read_harbor_task(HARBOR_TASKS / "shell-count").instruction
        assert info["template_id"] == task.template
        observation, reward, terminated, _, info = await env.step(
            {"tool": "bash", "command": "cd /app && sort -u words.txt | wc -l > count.txt"}
        )
        assert (reward, terminated) == (0.0, False)
        observation, reward, terminated, _, info = await env.step({"tool": "submit"})
        assert (reward, terminated) == (1.0, True), info
        assert info["reward_components"] == {"reward": 1.0}


@pytest.mark.docker
@pytest.mark.timeout(600)
async def test_a_task_on_the_docker_backend(tmp_path: Path) -> None:
    """The Dockerfile's FROM image as it is, the same steps built by the Engine."""
    from rollbox.sandbox.templates import Template, host_python_fingerprint
    from tests.sandbox._docker import containers_of, make_docker_provider

    docker = make_docker_provider()
    try:
        # no registry here: the task's image is rollbox's python base, imported on first use
        await docker.build_template(Template(name="harbor-test-base", base="python"))
        image = f"rollbox/python:{host_python_fingerprint()}"
        for name in CHEAP:
            shutil.copytree(HARBOR_TASKS / name, tmp_path / name)
            dockerfile = tmp_path / name / "environment" / "Dockerfile"
            dockerfile.write_text(
                dockerfile.read_text().replace("FROM python:3.11-slim", f"FROM {image}")
            )
        with pytest.raises(ConfigError, match="provider='docker'"):  # no such base locally
            read_harbor_tasks(tmp_path)
        tasks = read_harbor_tasks(tmp_path, backend="docker")
        assert {t.template("docker").base for t in tasks} == {image}
        for agent, score in (("oracle", 1.0), ("nop", 0.0)):
            rollouts = await run_rollouts(
                HarborDataset(tasks, provider=docker),
                harbor_agent(agent),
                provider=docker,
                score_in_agent_sandbox=True,
            )
            assert [(r.error, r.score) for r in rollouts] == [(None, score)] * 2, rollouts
    finally:
        await docker.close()
    assert not containers_of(docker)


# -- hidden tests -----------------------------------------------------------------------------------

SEARCHES = {
    # everything on the filesystem, contents included (the markers are in tests/ and solution/)
    f"grep -rl --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev {HIDDEN_MARKER} / "
    "2>/dev/null; echo searched": "searched",
    f"grep -rl --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev {SOLUTION_MARKER} / "
    "2>/dev/null; echo searched": "searched",
    "find / -xdev \\( -name 'check_slug*' -o -name test.sh -o -name solve.sh \\) 2>/dev/null; "
    "echo searched": "searched",
    "ls -A /tests /solution /logs/verifier": "/logs/verifier:\n\n/solution:\n\n/tests:",
}


def stdout_of(observation: str) -> str:
    return observation.partition("--- stdout ---\n")[2].split("\n--- stderr ---")[0]


async def test_hidden_tests_stay_hidden_from_the_agent(provider: object) -> None:
    [task] = load_harbor_tasks(HARBOR_TASKS / "hidden-tests")
    async with AsyncSandboxEnv(task, provider=provider) as env:  # type: ignore[arg-type]
        await env.reset()
        for command, found in SEARCHES.items():
            observation, *_ = await env.step({"tool": "bash", "command": command})
            assert stdout_of(observation) == found, (command, observation)
        solution = (
            "import re\n\ndef slugify(text):\n"
            "    return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')\n"
        )
        await env.step({"tool": "write_file", "path": "/app/slug.py", "content": solution})
        _, reward, terminated, _, info = await env.step({"tool": "submit"})
        assert (reward, terminated) == (1.0, True), info  # the tests were there when it counted


async def test_what_the_agent_plants_or_leaves_running_does_not_count(provider: object) -> None:
    """Fake tests in /tests, a reward file written in advance, and a process that keeps writing
    reward files: the agent's processes are killed, /tests and /logs/verifier emptied first."""
    [task] = load_harbor_tasks(HARBOR_TASKS / "hidden-tests")
    slug = "import re\n\ndef slugify(text):\n    return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')\n"
    cheat = (
        # a right answer where only the tests would import it from, fake tests, reward files
        "printf 'raise SystemExit(0)\\n' > /tests/check_slug.py && "
        "printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh && "
        "echo 1 > /logs/verifier/reward.txt && echo '{\"reward\": 1}' > /logs/verifier/reward.json"
        # and a process that keeps writing them
        " && (setsid sh -c 'while :; do echo 1 > /logs/verifier/reward.txt; "
        'echo "{\\"reward\\": 1}" > /logs/verifier/reward.json; sleep 0.01; done\' '
        ">/dev/null 2>&1 &) && echo planted"
    )
    async with AsyncSandboxEnv(task, provider=provider) as env:  # type: ignore[arg-type]
        await env.reset()
        await env.step({"tool": "write_file", "path": "/tests/slug.py", "content": slug})
        observation, *_ = await env.step({"tool": "bash", "command": cheat})
        assert "planted" in observation
        _, reward, _, _, info = await env.step({"tool": "submit"})
    assert reward == 0.0, info
    assert info["verifier"]["file"] == "reward.txt"  # the one the real test.sh wrote
    assert "No module named 'slug'" in info["verifier"]["test_output"]


async def test_a_usercustomize_in_the_agents_home_does_not_reach_the_verifier(
    provider: object,
) -> None:
    """Python imports ``usercustomize`` from ``~/.local`` at every start: planted in the agent's
    HOME it would turn the tests' failing exit into a pass. The verifier has a HOME of its own."""
    [task] = load_harbor_tasks(HARBOR_TASKS / "hidden-tests")
    plant = (
        "site=$(python3 -m site --user-site) && mkdir -p $site && "
        "echo 'import os, sys; sys.exit = lambda *a: os._exit(0)' > $site/usercustomize.py && "
        "printf 'def slugify(text):\\n    return text\\n' > /app/slug.py && "
        "python3 -c 'import sys; sys.exit(3)'; echo exit=$?"
    )
    async with AsyncSandboxEnv(task, provider=provider) as env:  # type: ignore[arg-type]
        await env.reset()
        observation, *_ = await env.step({"tool": "bash", "command": plant})
        assert stdout_of(observation) == "exit=0"  # the plant works for the agent's own commands
        _, reward, _, _, info = await env.step({"tool": "submit"})
    assert reward == 0.0, info
    assert "slugify('Hello, World!') = 'Hello, World!'" in info["verifier"]["test_output"]


# -- rollbox run --harbor -------------------------------------------------------------------------


def rollbox_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollbox", "run", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.timeout(300)
def test_rollbox_run_validates_a_task_set(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    for name in CHEAP:
        shutil.copytree(HARBOR_TASKS / name, tasks / name)
    for agent, score in (("oracle", 1.0), ("nop", 0.0)):
        done = rollbox_run("--harbor", str(tasks), "--agent", agent, "--out", str(tmp_path / agent))
        assert done.returncode == 0, done.stdout + done.stderr
        lines = (tmp_path / agent / "results.jsonl").read_text().splitlines()
        rollouts = {r["instance_id"]: r for r in map(json.loads, lines)}
        assert len(lines) == 2
        assert set(rollouts) == {"shell-count", "rollbox-tests/hidden-slug"}
        assert {r["score"] for r in rollouts.values()} == {score}
        run_record = json.loads((tmp_path / agent / "run.json").read_text())
        assert run_record["dataset"] == f"harbor:{tasks}"
        assert run_record["score_in_agent_sandbox"] is True

    # a broken task: its reference solution does not pass its tests
    solve = tasks / "shell-count" / "solution" / "solve.sh"
    solve.write_text("#!/bin/bash\necho 5 > count.txt\n")
    done = rollbox_run("--harbor", str(tasks), "--agent", "oracle", "--out", str(tmp_path / "o2"))
    assert done.returncode == 1
    assert "task shell-count: oracle scored 0.0, not 1.0" in done.stdout

    done = rollbox_run("--agent", "oracle", "--out", str(tmp_path / "neither"))
    assert done.returncode == 2 and "either --dataset" in done.stderr
