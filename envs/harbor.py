"""Harbor task directories as rollbox tasks, without the ``harbor`` package.

A Harbor task is a directory::

    task.toml          [verifier] [agent] [environment] [solution] tables (Harbor's schema)
    instruction.md     what the agent is told (leading canary lines are dropped, as Harbor does)
    environment/       Dockerfile and its build context, or [environment].docker_image
    tests/test.sh      run after the agent, writes /logs/verifier/reward.json or reward.txt
    solution/solve.sh  the reference solution (the ``oracle`` agent runs it)

``read_harbor_tasks(path)`` reads one such directory or a folder of them into
:class:`HarborTask` objects; ``load_harbor_tasks(path)`` turns them into rollbox
:class:`~rollbox.envs.task.Task` objects for ``SandboxEnv`` and friends; :class:`HarborDataset`
with :class:`OracleAgent` or :class:`NopAgent` runs them with ``run_rollouts`` (``rollbox run
--harbor PATH --agent oracle``).

How a task's environment maps onto a sandbox:

- The environment becomes a rollbox :class:`~rollbox.sandbox.templates.Template`. The Dockerfile
  subset ``FROM``, ``RUN``, ``COPY``/``ADD`` (local files), ``WORKDIR``, ``ENV``, ``ARG`` (with
  defaults), ``SHELL`` and ``USER root`` is translated step by step; ``LABEL``, ``EXPOSE``,
  ``CMD``, ``ENTRYPOINT`` and the like are ignored; anything else (multi-stage builds,
  ``COPY --from``, ``ONBUILD``, another ``USER``, ``ADD`` of a URL) is a ConfigError that names
  the line. On Docker the ``FROM`` image is used as it is. The local backend has no images: it
  maps ``python:*`` to the host's Python (or, when the task uses pip or apt, to Debian bookworm
  with python3 and pip), ``debian:*`` to that Debian suite and ``ubuntu:*`` to Debian bookworm
  (made by debootstrap, once), and refuses other bases.
- Harbor tasks run as root in their container; rollbox sandboxes run as an unprivileged user.
  The template's last step creates ``/logs/{agent,verifier,artifacts}``, ``/tests`` and
  ``/solution`` and hands them, the working directories and what the Dockerfile copied outside
  the system directories (``/usr``, ``/etc``, ``/bin``, ...) to the sandbox user. Everything
  else of the image stays root's: readable, not writable.
- ``tests/`` stays on the host until verification. Then every process the agent left is killed,
  ``/tests`` is emptied and filled, ``/logs/verifier`` is emptied, and ``tests/test.sh`` runs
  from the working directory as Harbor runs it; the reward is read as Harbor reads it
  (``reward.json``, else ``reward.txt``; see ``rollbox.rewards.RewardFile``).
- ``[agent].timeout_sec`` is the episode's time budget, ``[verifier].timeout_sec`` the test
  script's, ``cpus``/``memory_mb``/``storage_mb`` the sandbox's limits, ``network_mode`` (and
  ``allowed_hosts`` as IPv4 addresses or CIDRs) its network, ``[environment].env`` its
  environment (``${VAR}`` and ``${VAR:-default}`` read from the host, as Harbor does).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import posixpath
import re
import secrets
import shlex
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rollbox.envs.task import Task, TaskFile
from rollbox.errors import CommandError, ConfigError, SandboxFileError
from rollbox.sandbox.models import Limits, NetworkConfig, SandboxSpec, parse_network_rule
from rollbox.sandbox.templates import (
    SANDBOX_UID,
    AptStep,
    CopyStep,
    EnvStep,
    RunStep,
    Step,
    Template,
    WorkdirStep,
    short,
)

if TYPE_CHECKING:
    from rollbox.rewards import RewardResult
    from rollbox.runner import AgentResult
    from rollbox.sandbox.base import AsyncSandbox, Provider

LOGS_DIR = "/logs"
AGENT_LOGS_DIR = "/logs/agent"
VERIFIER_LOGS_DIR = "/logs/verifier"
ARTIFACTS_DIR = "/logs/artifacts"
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
TEST_SCRIPT = "/tests/test.sh"
SOLVE_SCRIPT = "/solution/solve.sh"
TEST_OUTPUT = "/logs/verifier/test-stdout.txt"
ORACLE_OUTPUT = "/logs/agent/oracle.txt"

# What a Harbor task gets when task.toml names no limit (Docker would give it no cap at all).
DEFAULT_LIMITS = Limits(memory_mb=2048, pids=1024, cpus=1.0, disk_mb=2048)
# Top-level directories of the image that stay root's even when the Dockerfile copies into them:
# handing them to the sandbox user would let the agent swap the tools the verifier runs.
_SYSTEM_DIRS = frozenset(
    {"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin",
     "sys", "usr"}
)  # fmt: skip
_DOCKER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Commands that need a package manager: a python:* task that uses them gets a Debian base.
_NEEDS_PACKAGES = re.compile(r"(?<![\w./-])(apt-get|apt|dpkg|pip3?|uv|uvx|ensurepip)(?![\w-])")
# A Docker image's PATH, for every command of a task's sandbox (its agent's and its verifier's):
# the local backend's default PATH starts with /.rollbox/bin, which a layered template's sandbox
# user can write to, and a verifier must not run what the agent put there.
_IMAGE_PATH = EnvStep(env={"PATH": _DOCKER_PATH})
_CANARY_LINE = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
_ENV_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


# -- task.toml -------------------------------------------------------------------------------------


class _Table(BaseModel):
    # Harbor ignores keys it does not know (newer schema versions add some): so does rollbox.
    model_config = ConfigDict(extra="ignore", frozen=True)


NetworkMode = Literal["no-network", "public", "allowlist"]


class HarborHealthcheck(_Table):
    command: str = Field(min_length=1)
    interval_sec: float = Field(5.0, ge=0)
    timeout_sec: float = Field(30.0, gt=0)
    start_period_sec: float = Field(0.0, ge=0)
    start_interval_sec: float = Field(5.0, ge=0)
    retries: int = Field(3, ge=1)


class HarborEnvironmentConfig(_Table):
    build_timeout_sec: float = Field(600.0, gt=0)
    docker_image: str | None = None
    os: str = "linux"
    cpus: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    storage_mb: int | None = Field(None, gt=0)
    memory: str | None = None  # deprecated by Harbor: "2G"
    storage: str | None = None  # deprecated by Harbor: "10G"
    gpus: int | None = Field(None, ge=0)
    tpu: dict[str, Any] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    healthcheck: HarborHealthcheck | None = None
    network_mode: NetworkMode | None = None
    allowed_hosts: list[str] | None = None
    allow_internet: bool | None = None  # deprecated by Harbor: network_mode

    @field_validator("os")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()


class HarborAgentConfig(_Table):
    timeout_sec: float | None = Field(None, gt=0)
    user: str | int | None = None
    network_mode: NetworkMode | None = None
    allowed_hosts: list[str] | None = None


class HarborVerifierConfig(_Table):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    user: str | int | None = None
    network_mode: NetworkMode | None = None
    allowed_hosts: list[str] | None = None
    environment_mode: Literal["shared", "separate"] | None = None
    environment: dict[str, Any] | None = None


class HarborSolutionConfig(_Table):
    env: dict[str, str] = Field(default_factory=dict)


class HarborPackageInfo(_Table):
    name: str = Field(min_length=1)


class HarborTaskConfig(_Table):
    """The parts of Harbor's ``task.toml`` schema (1.x) that rollbox reads."""

    schema_version: str = "1.4"
    task: HarborPackageInfo | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: HarborVerifierConfig = Field(default_factory=HarborVerifierConfig)
    agent: HarborAgentConfig = Field(default_factory=HarborAgentConfig)
    environment: HarborEnvironmentConfig = Field(default_factory=HarborEnvironmentConfig)
    solution: HarborSolutionConfig = Field(default_factory=HarborSolutionConfig)
    steps: list[dict[str, Any]] | None = None


def read_task_config(path: str | os.PathLike[str]) -> HarborTaskConfig:
    """Parse and validate a ``task.toml``.

    Raises:
        ConfigError: not TOML, or a field of the wrong type; the message names file and field.
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    if "version" in data:  # Harbor's old name of the field
        data.setdefault("schema_version", data.pop("version"))
    try:
        return HarborTaskConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"
            for error in exc.errors()[:5]
        )
        raise ConfigError(f"{source}: {problems}") from exc


def _size_mb(text: str, where: str) -> int:
    """Harbor's deprecated sizes: ``"2G"``, ``"512M"``."""
    value = text.strip().upper()
    try:
        if value.endswith("G"):
            return int(float(value[:-1]) * 1024)
        if value.endswith("M"):
            return int(float(value[:-1]))
        if value.endswith("K"):
            return int(float(value[:-1]) / 1024)
    except ValueError:
        pass
    raise ConfigError(f"{where}: {text!r} is not a size such as '2G' or '512M'")


def resolve_env(env: Mapping[str, str], where: str) -> dict[str, str]:
    """``${VAR}`` and ``${VAR:-default}`` values read from the host's environment, as Harbor
    does."""
    resolved = {}
    for key, value in env.items():
        match = _ENV_TEMPLATE.fullmatch(value)
        if match is None:
            resolved[key] = value
        elif match.group(1) in os.environ:
            resolved[key] = os.environ[match.group(1)]
        elif match.group(2) is not None:
            resolved[key] = match.group(2)
        else:
            raise ConfigError(
                f"{where}.{key}: ${{{match.group(1)}}} is not set in this environment; set it "
                f"(or write ${{{match.group(1)}:-default}} in task.toml)"
            )
    return resolved


def harbor_network(mode: str, allowed_hosts: Sequence[str] | None, where: str) -> NetworkConfig:
    """A Harbor network mode as a rollbox NetworkConfig (public is every IPv4 address)."""
    if mode == "no-network":
        return NetworkConfig()
    if mode == "public":
        return NetworkConfig(allow_out=("0.0.0.0/0",))
    rules = []
    for host in allowed_hosts or ():
        try:
            network, _port = parse_network_rule(host)
        except ValueError:
            network = None
        if network is None or network.version != 4:
            raise ConfigError(
                f"{where}.allowed_hosts: {host!r}: rollbox allow-lists hold IPv4 addresses and "
                "CIDRs, not hostnames or IPv6; resolve it and list its addresses"
            )
        rules.append(host)
    if not rules:
        raise ConfigError(f"{where}: network_mode = 'allowlist' needs allowed_hosts")
    return NetworkConfig(allow_out=tuple(rules))


def strip_canary(text: str) -> str:
    """Drop leading canary comment lines (and the blank lines after them), as Harbor does."""
    lines = text.split("\n")
    index = 0
    while index < len(lines) and _CANARY_LINE.match(lines[index].strip()):
        index += 1
    while index < len(lines) and not lines[index].strip():
        index += 1
    return "\n".join(lines[index:])


# -- the Dockerfile --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Instruction:
    line: int
    keyword: str
    text: str
    heredocs: tuple[tuple[str, str], ...] = ()


_HEREDOC = re.compile(r"<<(-?)([\"']?)([A-Za-z_][A-Za-z0-9_.]*)\2")


def parse_dockerfile(text: str, where: str) -> list[_Instruction]:
    """Instructions of a Dockerfile: continuations joined, comments dropped, heredocs read."""
    lines = text.splitlines()
    instructions = []
    index = 0
    while index < len(lines) and (directive := re.match(r"#\s*(\w+)\s*=\s*(.*)", lines[index])):
        if directive.group(1).lower() == "escape" and directive.group(2).strip() != "\\":
            raise ConfigError(f"{where} line {index + 1}: only the '\\' escape is supported")
        index += 1
    while index < len(lines):
        start = index
        current = lines[index].rstrip()
        index += 1
        if not current.strip() or current.lstrip().startswith("#"):
            continue
        parts = []
        while current.endswith("\\"):
            parts.append(current[:-1])
            while index < len(lines) and (
                not lines[index].strip() or lines[index].lstrip().startswith("#")
            ):
                index += 1
            if index >= len(lines):
                current = ""
                break
            current = lines[index].rstrip()
            index += 1
        parts.append(current)
        logical = "".join(parts).strip()
        keyword, _, rest = logical.partition(" ")
        if "\t" in keyword:
            keyword, _, tail = keyword.partition("\t")
            rest = f"{tail} {rest}"
        keyword = keyword.upper()
        heredocs = []
        if keyword in ("RUN", "COPY", "ADD"):
            for match in _HEREDOC.finditer(rest):
                body = []
                while index < len(lines):
                    line = lines[index]
                    index += 1
                    if (line.lstrip("\t") if match.group(1) else line) == match.group(3):
                        break
                    body.append(line.lstrip("\t") if match.group(1) else line)
                else:
                    raise ConfigError(
                        f"{where} line {start + 1}: heredoc {match.group(3)} is never closed"
                    )
                heredocs.append((match.group(3), "\n".join(body) + "\n"))
        instructions.append(_Instruction(start + 1, keyword, rest.strip(), tuple(heredocs)))
    return instructions


_VARIABLE = re.compile(
    r"\\\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)"
)


def _expand(text: str, variables: Mapping[str, str]) -> str:
    """Docker's variable substitution: ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR:+x}``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return "$"
        name = match.group(1) or match.group(4)
        value = variables.get(name, "")
        if match.group(2) == ":-":
            return value or match.group(3)
        if match.group(2) == ":+":
            return match.group(3) if value else ""
        return value

    return _VARIABLE.sub(replace, text)


def _flags(text: str) -> tuple[dict[str, str], str]:
    """Leading ``--name=value`` flags of an instruction, and the rest."""
    flags = {}
    while match := re.match(r"--([a-z-]+)(?:=(\S*))?\s+", text):
        flags[match.group(1)] = match.group(2) or ""
        text = text[match.end() :]
    return flags, text


def _exec_form(text: str) -> list[str] | None:
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


@dataclass(frozen=True)
class HarborImage:
    """What a task's environment became: a template, where commands start, and how it differs."""

    template: Template
    workdir: str
    notes: tuple[str, ...] = ()


def _local_base(image: str, needs_packages: bool, where: str) -> tuple[str, list[Step], str]:
    """The local backend's stand-in for a Docker base image: (base, prelude steps, note)."""
    reference = image.split("@", 1)[0]
    for prefix in ("docker.io/library/", "docker.io/", "library/"):
        reference = reference.removeprefix(prefix)
    name, _, tag = reference.partition(":")
    tag = tag or "latest"
    suites = {"11": "bullseye", "12": "bookworm", "13": "trixie"}
    if name == "python":
        suite = next((s for s in ("bullseye", "trixie") if s in tag), "bookworm")
        if not needs_packages:
            return "python", [], f"{image}: the host's Python and tools (no pip, no apt)"
        prelude: list[Step] = [
            AptStep(apt=("python3", "python3-pip", "python3-venv", "ca-certificates")),
            RunStep(
                run="ln -sf /usr/bin/python3 /usr/local/bin/python && "
                "ln -sf /usr/bin/pip3 /usr/local/bin/pip"
            ),
            # python:* images let pip install into the system Python; Debian's needs telling
            EnvStep(env={"PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_ROOT_USER_ACTION": "ignore"}),
        ]
        return f"debian:{suite}", prelude, f"{image}: Debian {suite} with its python3 and pip"
    if name == "debian":
        version = tag.split("-")[0]
        suite = suites.get(version.split(".")[0], version)
        if suite in ("latest", "stable"):
            suite = "bookworm"
        if suite not in ("bullseye", "bookworm", "trixie", "sid"):
            raise ConfigError(f"{where}: FROM {image}: unknown Debian release {tag!r}")
        return f"debian:{suite}", [], f"{image}: Debian {suite} made by debootstrap"
    if name == "ubuntu":
        return "debian:bookworm", [], f"{image}: approximated by Debian bookworm (no Ubuntu here)"
    raise ConfigError(
        f"{where}: FROM {image}: the local backend makes python:*, debian:* and ubuntu:* bases "
        "only; run this task with provider='docker' (`rollbox run --provider docker`)"
    )


def translate_dockerfile(
    dockerfile: Path,
    *,
    name: str,
    backend: Literal["local", "docker"] = "local",
    workdir: str | None = None,
    also_scan: Iterable[str] = (),
) -> HarborImage:
    """A Dockerfile (the supported subset) as a rollbox Template for ``backend``.

    ``also_scan`` is the text of scripts that run in the image (test.sh, solve.sh): a python:*
    task whose scripts use pip or apt gets a Debian base locally.

    Raises:
        ConfigError: an instruction outside the subset, a missing COPY source; names the line.
    """
    where = str(dockerfile)
    context = dockerfile.parent.resolve()
    try:
        instructions = parse_dockerfile(dockerfile.read_text(encoding="utf-8"), where)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read: {exc}") from exc
    if (context / ".dockerignore").exists():
        raise ConfigError(
            f"{context / '.dockerignore'}: .dockerignore is not supported; move the files it "
            "excludes out of environment/"
        )
    froms = [i for i in instructions if i.keyword == "FROM"]
    if not froms:
        raise ConfigError(f"{where}: no FROM instruction")
    if len(froms) > 1:
        raise ConfigError(
            f"{where} line {froms[1].line}: multi-stage builds (a second FROM) are not "
            "supported; build the image yourself and set [environment].docker_image"
        )
    run_text = "\n".join(i.text for i in instructions if i.keyword == "RUN")
    needs_packages = bool(_NEEDS_PACKAGES.search("\n".join([run_text, *also_scan])))
    variables: dict[str, str] = {"PATH": _DOCKER_PATH}
    build_args: dict[str, str] = {}
    steps: list[Step] = []
    notes: list[str] = []
    cwd = "/"
    workdirs: list[str] = []
    owned: list[str] = []  # paths to hand to the sandbox user, beside the workdirs
    shell: list[str] | None = None
    base = ""
    for instruction in instructions:
        at = f"{where} line {instruction.line}"
        keyword, text = instruction.keyword, instruction.text
        if keyword == "ARG":
            for token in shlex.split(text):
                arg, has_default, default = token.partition("=")
                if not has_default and arg not in build_args:
                    raise ConfigError(
                        f"{at}: ARG {arg} has no default, and no build arguments are passed; "
                        f"give it one (ARG {arg}=value)"
                    )
                build_args[arg] = (
                    _expand(default, {**variables, **build_args})
                    if has_default
                    else build_args[arg]
                )
            continue
        if keyword == "FROM":
            flags, text = _flags(text)
            image = _expand(text.split()[0], build_args)
            if backend == "docker":
                base = image
            else:
                base, prelude, note = _local_base(image, needs_packages, at)
                steps.extend([_IMAGE_PATH, *prelude])
                notes.append(note)
            continue
        if not base:
            raise ConfigError(f"{at}: {keyword} before FROM")
        scope = {**variables, **build_args}
        if keyword == "RUN":
            flags, text = _flags(text)
            mounts = [v for k, v in flags.items() if k == "mount" and "type=cache" not in v]
            if mounts:
                raise ConfigError(f"{at}: RUN --mount={mounts[0]} is not supported")
            command = _run_command(text, instruction.heredocs, shell)
            if build_args:
                exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in build_args.items())
                command = f"export {exports}\n{command}"
            steps.append(RunStep(run=command))
        elif keyword == "ENV":
            values = _env_values(text, scope, at)
            variables.update(values)
            steps.append(EnvStep(env=values))
        elif keyword == "WORKDIR":
            cwd = posixpath.normpath(posixpath.join(cwd, _expand(text, scope)))
            workdirs.append(cwd)
            steps.append(WorkdirStep(workdir=cwd))
        elif keyword in ("COPY", "ADD"):
            copied, paths = _copy_steps(instruction, context, cwd, scope, at)
            steps.extend(copied)
            owned.extend(paths)
        elif keyword == "SHELL":
            shell = _exec_form(text)
            if not shell:
                raise ConfigError(f'{at}: SHELL takes a JSON array, e.g. ["/bin/bash", "-c"]')
        elif keyword == "USER":
            if _expand(text, scope).split(":")[0] not in ("root", "0"):
                raise ConfigError(
                    f"{at}: USER {text}: rollbox runs every command as one unprivileged user; "
                    "only USER root is accepted (and changes nothing)"
                )
        elif keyword == "VOLUME":
            paths = _exec_form(text) or _expand(text, scope).split()
            steps.append(RunStep(run="mkdir -p " + " ".join(shlex.quote(p) for p in paths)))
            owned.extend(posixpath.join(cwd, p) for p in paths)
        elif keyword in ("LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "STOPSIGNAL", "HEALTHCHECK",
                         "MAINTAINER"):  # fmt: skip
            continue  # nothing a sandbox uses: Harbor keeps its own container running
        else:
            raise ConfigError(f"{at}: {keyword} is not supported")
    final_workdir = posixpath.normpath(workdir) if workdir else cwd
    steps.append(RunStep(run=_hand_over_command([final_workdir, *workdirs], owned)))
    if backend == "docker":
        # rollbox's in-sandbox agent is Python: an image without it gets it from its package manager
        steps.append(
            RunStep(
                run="command -v python3 >/dev/null || { { command -v apt-get >/dev/null && "
                "apt-get update -q && apt-get install -y -q --no-install-recommends python3; } || "
                "{ command -v apk >/dev/null && apk add --no-cache python3; }; }"
            )
        )
    template = Template.parse(
        {"name": name, "base": base, "steps": [s.model_dump(by_alias=True) for s in steps]},
        where=where,
    )
    return HarborImage(template=template, workdir=final_workdir, notes=tuple(notes))


def image_template(
    image: str,
    *,
    name: str,
    backend: Literal["local", "docker"] = "local",
    workdir: str | None = None,
    also_scan: Iterable[str] = (),
) -> HarborImage:
    """A prebuilt image (``[environment].docker_image``) as a Template: on Docker as it is."""
    steps: list[Step] = []
    notes: tuple[str, ...] = ()
    if backend == "docker":
        base = image
    else:
        needs_packages = bool(_NEEDS_PACKAGES.search("\n".join(also_scan)))
        base, prelude, note = _local_base(image, needs_packages, "[environment].docker_image")
        steps = [_IMAGE_PATH, *prelude]
        notes = (note,)
    final_workdir = posixpath.normpath(workdir) if workdir else "/"
    steps.append(RunStep(run=_hand_over_command([final_workdir], [])))
    template = Template.parse(
        {"name": name, "base": base, "steps": [s.model_dump(by_alias=True) for s in steps]},
        where="[environment].docker_image",
    )
    return HarborImage(template=template, workdir=final_workdir, notes=notes)


def _run_command(text: str, heredocs: Sequence[tuple[str, str]], shell: list[str] | None) -> str:
    exec_form = _exec_form(text)
    if exec_form is not None:
        return shlex.join(exec_form)
    if heredocs and _HEREDOC.fullmatch(text.strip()):
        body = heredocs[0][1]
        if body.startswith("#!"):  # a script with its own interpreter, as BuildKit runs it
            script = f"/tmp/.rollbox-run-{_digest(body)}"
            return (
                f"{_write_file_command(script, body)}chmod +x {script} && {script}; "
                f"code=$?; rm -f {script}; exit $code"
            )
        command = body
    else:
        command = text + "".join(f"\n{body}{delimiter}" for delimiter, body in heredocs)
    if shell is not None:
        return f"exec {shlex.join(shell)} {shlex.quote(command)}"
    return command


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_file_command(path: str, content: str) -> str:
    # deterministic (the template's digest depends on it), and never a line of the content
    delimiter = f"ROLLBOX_EOF_{_digest(content)}"
    return (
        f"mkdir -p {shlex.quote(posixpath.dirname(path) or '/')} && "
        f"cat > {shlex.quote(path)} <<'{delimiter}'\n{content}{delimiter}\n"
    )


def _env_values(text: str, scope: Mapping[str, str], at: str) -> dict[str, str]:
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{at}: ENV {text}: {exc}") from exc
    if not tokens:
        raise ConfigError(f"{at}: ENV needs a name and a value")
    if "=" not in tokens[0]:  # the legacy form: ENV NAME value with spaces
        name, _, value = text.partition(" ")
        return {name: _expand(value.strip(), scope)}
    values: dict[str, str] = {}
    for token in tokens:
        key, has_value, value = token.partition("=")
        if not has_value:
            raise ConfigError(f"{at}: ENV {token}: expected NAME=value")
        values[key] = _expand(value, {**scope, **values})
    return values


def _copy_steps(
    instruction: _Instruction, context: Path, cwd: str, scope: Mapping[str, str], at: str
) -> tuple[list[Step], list[str]]:
    """COPY/ADD as copy steps (plus chmod or unpacking); also the absolute paths written."""
    flags, text = _flags(instruction.text)
    keyword = instruction.keyword
    unknown = sorted(set(flags) - {"chown", "chmod", "link"})
    if "from" in flags:
        raise ConfigError(
            f"{at}: {keyword} --from (a multi-stage build) is not supported; build the image "
            "yourself and set [environment].docker_image"
        )
    if unknown:
        raise ConfigError(f"{at}: {keyword} --{unknown[0]} is not supported")
    words = _exec_form(text) or shlex.split(text)
    if len(words) < 2 and not instruction.heredocs:
        raise ConfigError(f"{at}: {keyword} needs a source and a destination")
    destination = _expand(words[-1], scope)
    absolute = posixpath.normpath(posixpath.join(cwd, destination))
    steps: list[Step] = []
    written: list[str] = []
    if instruction.heredocs:
        for delimiter, body in instruction.heredocs:
            target = posixpath.join(absolute, delimiter) if destination.endswith("/") else absolute
            steps.append(RunStep(run=_write_file_command(target, body)))
            written.append(target)
        return steps, written
    sources: list[Path] = []
    for pattern in words[:-1]:
        pattern = _expand(pattern, scope)
        if re.match(r"^[a-z]+://|^git@", pattern):
            raise ConfigError(f"{at}: {keyword} of a URL ({pattern}) is not supported")
        if posixpath.isabs(pattern) or ".." in pattern.split("/"):
            raise ConfigError(f"{at}: {keyword} source {pattern!r} is outside environment/")
        matches = sorted(glob.glob(str(context / pattern))) if glob.has_magic(pattern) else []
        found = [Path(m) for m in matches] or [context / pattern]
        for path in found:
            if not path.exists():
                raise ConfigError(f"{at}: {keyword} source {pattern!r} not found in {context}")
            if not path.resolve().is_relative_to(context):
                raise ConfigError(f"{at}: {keyword} source {pattern!r} leads outside {context}")
            sources.append(path.resolve())
    into_directory = destination.endswith("/") or len(sources) > 1
    for source in sources:
        archive = keyword == "ADD" and source.is_file() and source.name.endswith(_ARCHIVE_SUFFIXES)
        if archive:  # ADD unpacks local archives
            staged = f"/tmp/.rollbox-add-{_digest(str(source))}-{source.name}"
            steps.append(CopyStep(copy=str(source), to=staged))
            steps.append(
                RunStep(
                    run=f"mkdir -p {shlex.quote(absolute)} && tar -xf {staged} -C "
                    f"{shlex.quote(absolute)} && rm -f {staged}"
                )
            )
            written.append(absolute)
            continue
        target = absolute
        if source.is_file() and into_directory:
            target = posixpath.join(absolute, source.name)
        steps.append(CopyStep(copy=str(source), to=target))
        written.append(target)
        if flags.get("chmod"):
            steps.append(
                RunStep(run=f"chmod -R {shlex.quote(flags['chmod'])} {shlex.quote(target)}")
            )
    return steps, written


def _hand_over_command(workdirs: Sequence[str], copied: Sequence[str]) -> str:
    """The last build step: Harbor's directories, and the task's own, for the sandbox user.

    Ancestors are handed over as directories only (so that the sandbox can write below them:
    a directory it does not own cannot be copied up into its overlay); the paths themselves
    recursively. Paths under the system directories stay root's.
    """
    paths = [LOGS_DIR, TESTS_DIR, SOLUTION_DIR, *workdirs]
    paths += [p for p in copied if p.strip("/").split("/")[0] not in _SYSTEM_DIRS]
    recursive: list[str] = []
    ancestors: list[str] = []
    for path in dict.fromkeys(posixpath.normpath(p) for p in paths):
        if path == "/" or path.strip("/").split("/")[0] in _SYSTEM_DIRS:
            continue
        recursive.append(path)
        parent = posixpath.dirname(path)
        while parent != "/":
            ancestors.append(parent)
            parent = posixpath.dirname(parent)
    made = [AGENT_LOGS_DIR, VERIFIER_LOGS_DIR, ARTIFACTS_DIR, TESTS_DIR, SOLUTION_DIR, *workdirs]
    made = [p for p in dict.fromkeys(made) if p != "/"]
    owner = f"{SANDBOX_UID}:{SANDBOX_UID}"
    command = "mkdir -p " + " ".join(shlex.quote(p) for p in made)
    command += f" && chown -R {owner} " + " ".join(shlex.quote(p) for p in recursive)
    if ancestors:
        unique = dict.fromkeys(a for a in ancestors if a not in recursive)
        if unique:
            command += f" && chown {owner} " + " ".join(shlex.quote(p) for p in unique)
    return command


# -- tasks -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HarborTask:
    """One Harbor task directory, read and checked; nothing of it is in any sandbox yet.

    ``tests`` and ``solution`` are the files of ``tests/`` and ``solution/``: they stay here, on
    the host, until the verifier (or the oracle) writes them into the sandbox.
    """

    id: str
    path: Path
    config: HarborTaskConfig
    instruction: str
    tests: dict[str, TaskFile]
    solution: dict[str, TaskFile]
    env_vars: dict[str, str]
    verifier_env: dict[str, str]
    solution_env: dict[str, str]
    limits: Limits
    network: NetworkConfig
    _images: dict[str, HarborImage] = field(default_factory=dict, repr=False, compare=False)

    @property
    def agent_timeout_seconds(self) -> float | None:
        return self.config.agent.timeout_sec

    @property
    def verifier_timeout_seconds(self) -> float:
        return self.config.verifier.timeout_sec

    @property
    def ttl_seconds(self) -> float:
        """How long its sandbox may live: the agent's and the verifier's budgets, with margin."""
        return (self.agent_timeout_seconds or 3600.0) + self.verifier_timeout_seconds + 600.0

    def image(self, backend: Literal["local", "docker"] = "local") -> HarborImage:
        """The task's environment as a Template for ``backend`` (translated once)."""
        if backend not in self._images:
            self._images[backend] = _task_image(self, backend)
        return self._images[backend]

    def template(self, backend: Literal["local", "docker"] = "local") -> Template:
        return self.image(backend).template

    @property
    def workdir(self) -> str:
        """Where the task's commands start: ``[environment].workdir``, else the last WORKDIR."""
        images = self._images
        return (images.get("local") or images.get("docker") or self.image("local")).workdir

    def environment_files(self) -> dict[str, TaskFile]:
        """For a ``docker_image`` task without a Dockerfile: environment/ goes to the workdir."""
        environment = self.path / "environment"
        if (
            not self.config.environment.docker_image
            or (environment / "Dockerfile").exists()
            or not environment.is_dir()
        ):
            return {}
        files = _read_files(environment)
        return {posixpath.join(self.workdir, name): file for name, file in files.items()}

    def healthcheck_command(self) -> str | None:
        """``[environment].healthcheck`` as one command: the check, retried as Harbor does."""
        check = self.config.environment.healthcheck
        if check is None:
            return None
        attempts = check.retries + int(check.start_period_sec // max(check.start_interval_sec, 1))
        command = shlex.quote(check.command)
        return (
            f"i=0; while :; do timeout {check.timeout_sec:g} sh -c {command} && exit 0; "
            f'i=$((i+1)); [ "$i" -ge {attempts} ] && exit 1; sleep {check.interval_sec:g}; done'
        )

    def to_task(self, *, build: bool = True, max_turns: int = 100) -> Task:
        """This task as a rollbox Task for ``SandboxEnv`` (its template built locally first).

        The agent's commands start in ``/work``, as in every rollbox Task, not in the task's
        working directory (``metadata["harbor"]["workdir"]``); Harbor instructions name their
        paths. The Task's template is the built template's digest name (``tpl-...``). With
        ``build=False`` nothing is built: build ``task.metadata["harbor"]["template"]`` (a
        Template definition) on your provider first.
        """
        image = self.image("local")
        if build:
            from rollbox.sandbox.templates import build_local

            build_local(image.template)
        budget = self.agent_timeout_seconds
        health = self.healthcheck_command()
        check = self.config.environment.healthcheck
        return Task(
            id=self.id,
            instruction=self.instruction,
            template=short(image.template.digest),
            files=self.environment_files(),
            setup=(health,) if health else (),
            setup_timeout_seconds=(
                (check.retries + 2) * (check.timeout_sec + check.interval_sec)
                + check.start_period_sec
                if check
                else 600.0
            ),
            env_vars=self.env_vars,
            limits=self.limits,
            network=self.network,
            max_turns=max_turns,
            step_timeout_seconds=budget or 1800.0,
            episode_timeout_seconds=budget or 1800.0,
            verifier=HarborVerifier(self),
            metadata={
                **self.config.metadata,
                "harbor": {
                    "path": str(self.path),
                    "workdir": image.workdir,
                    "notes": list(image.notes),
                    "template": image.template.model_dump(mode="json", by_alias=True),
                    "verifier_timeout_sec": self.verifier_timeout_seconds,
                },
            },
        )


def _texts(files: Iterable[TaskFile]) -> list[str]:
    return [f.content for f in files if isinstance(f.content, str)]


def task_scripts(task_dir: Path | None) -> list[str]:
    """The text files of a task's tests/ and solution/: whether they use pip or apt decides the
    local base of a python:* task."""
    texts: list[str] = []
    for folder in ("tests", "solution"):
        if task_dir is not None and (task_dir / folder).is_dir():
            with contextlib.suppress(ConfigError, OSError):
                texts += _texts(_read_files(task_dir / folder).values())
    return texts


def _task_image(task: HarborTask, backend: Literal["local", "docker"]) -> HarborImage:
    environment = task.config.environment
    name = "harbor-" + re.sub(r"[^a-zA-Z0-9_.-]+", "-", task.id).strip("-.")[:100]
    scan = _texts((*task.tests.values(), *task.solution.values()))
    dockerfile = task.path / "environment" / "Dockerfile"
    if dockerfile.exists():
        return translate_dockerfile(
            dockerfile, name=name, backend=backend, workdir=environment.workdir, also_scan=scan
        )
    assert environment.docker_image  # checked when the task was read
    return image_template(
        environment.docker_image,
        name=name,
        backend=backend,
        workdir=environment.workdir,
        also_scan=scan,
    )


def _read_files(root: Path) -> dict[str, TaskFile]:
    """Every file under ``root`` as ``{relative path: TaskFile}`` (text stays text)."""
    files: dict[str, TaskFile] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            source = Path(dirpath) / name
            if source.is_symlink():
                raise ConfigError(f"{source}: symlinks are not supported in a Harbor task")
            if name == ".harborignore":
                raise ConfigError(
                    f"{source}: .harborignore is not supported; remove the files it excludes"
                )
            if name.endswith(".pyc") or "__pycache__" in source.parts:
                continue
            data = source.read_bytes()
            try:
                content: str | bytes = data.decode("utf-8")
            except UnicodeDecodeError:
                content = data
            relative = source.relative_to(root).as_posix()
            files[relative] = TaskFile(content=content, mode=source.stat().st_mode & 0o777)
    return files


def read_harbor_task(
    path: str | os.PathLike[str], *, backend: Literal["local", "docker"] = "local"
) -> HarborTask:
    """Read and check one Harbor task directory; its template for ``backend`` is translated too.

    Raises:
        ConfigError: a missing file, a bad task.toml, or a feature rollbox cannot run (GPUs,
            Windows, Docker Compose, multi-step tasks, a separate verifier environment, ...);
            the message names the file and field.
    """
    root = Path(path).resolve()
    manifest = root / "task.toml"
    if not manifest.is_file():
        raise ConfigError(f"{root}: no task.toml (is this a Harbor task directory?)")
    config = read_task_config(manifest)
    environment = config.environment
    problems = {
        "steps": (config.steps, "multi-step tasks ([[steps]]) are not supported"),
        "environment.os": (
            environment.os != "linux",
            f"os = {environment.os!r}: rollbox runs Linux sandboxes only",
        ),
        "environment.gpus": (
            environment.gpus,
            f"gpus = {environment.gpus}: rollbox sandboxes have no GPUs",
        ),
        "environment.tpu": (environment.tpu, "rollbox sandboxes have no TPUs"),
        "verifier.environment": (
            config.verifier.environment is not None
            or config.verifier.environment_mode == "separate",
            "a separate verifier environment is not supported: rollbox verifies in the agent's "
            "sandbox after killing the agent's processes (Harbor's 'shared' mode)",
        ),
    }
    for name, (present, message) in problems.items():
        if present:
            raise ConfigError(f"{manifest}: {name}: {message}")
    env_dir = root / "environment"
    for compose in ("docker-compose.yaml", "docker-compose.yml"):
        if (env_dir / compose).exists():
            raise ConfigError(f"{env_dir / compose}: Docker Compose environments are not supported")
    if not environment.docker_image and not (env_dir / "Dockerfile").is_file():
        raise ConfigError(
            f"{root}: no environment/Dockerfile and no [environment].docker_image: say what the "
            "task's sandbox is made of"
        )
    instruction_path = root / "instruction.md"
    if not instruction_path.is_file():
        raise ConfigError(f"{root}: no instruction.md (what the agent is told)")
    instruction = strip_canary(instruction_path.read_text(encoding="utf-8"))
    if not instruction.strip():
        raise ConfigError(f"{instruction_path}: empty instruction")
    if not (root / "tests" / "test.sh").is_file():
        raise ConfigError(f"{root}: no tests/test.sh (it scores the agent's work)")
    tests = _read_files(root / "tests")
    solution = _read_files(root / "solution") if (root / "solution").is_dir() else {}

    limits = DEFAULT_LIMITS
    memory = environment.memory_mb or (
        _size_mb(environment.memory, f"{manifest}: environment.memory")
        if environment.memory
        else None
    )
    storage = environment.storage_mb or (
        _size_mb(environment.storage, f"{manifest}: environment.storage")
        if environment.storage
        else None
    )
    limits = limits.model_copy(
        update={
            k: v
            for k, v in (("cpus", environment.cpus), ("memory_mb", memory), ("disk_mb", storage))
            if v is not None
        }
    )
    mode = environment.network_mode
    if mode is None:
        mode = "no-network" if environment.allow_internet is False else "public"
    for phase in ("agent", "verifier"):
        override = getattr(config, phase).network_mode
        if override is not None and override != mode:
            raise ConfigError(
                f"{manifest}: {phase}.network_mode = {override!r} differs from the "
                f"environment's {mode!r}: a rollbox sandbox keeps one network policy for its "
                "life; set [environment].network_mode only"
            )
    network = harbor_network(mode, environment.allowed_hosts, f"{manifest}: environment")
    task = HarborTask(
        id=config.task.name if config.task else root.name,
        path=root,
        config=config,
        instruction=instruction,
        tests=tests,
        solution=solution,
        env_vars=resolve_env(environment.env, f"{manifest}: environment.env"),
        verifier_env=resolve_env(config.verifier.env, f"{manifest}: verifier.env"),
        solution_env=resolve_env(config.solution.env, f"{manifest}: solution.env"),
        limits=limits,
        network=network,
    )
    task.image(backend)  # an unsupported Dockerfile is an error now, not at the first episode
    return task


def read_harbor_tasks(
    path: str | os.PathLike[str], *, backend: Literal["local", "docker"] = "local"
) -> list[HarborTask]:
    """A Harbor task directory, or a folder of them (its subdirectories with a task.toml).

    Raises:
        ConfigError: nothing to load, a bad task (named), or two tasks with one name.
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such directory")
    if (root / "task.toml").is_file():
        return [read_harbor_task(root, backend=backend)]
    directories = [d for d in sorted(root.iterdir()) if (d / "task.toml").is_file()]
    if not directories:
        raise ConfigError(f"{root}: no task.toml here nor in any subdirectory")
    tasks: list[HarborTask] = []
    seen: dict[str, Path] = {}
    for directory in directories:
        task = read_harbor_task(directory, backend=backend)
        if task.id in seen:
            raise ConfigError(f"{directory} and {seen[task.id]} are both task {task.id!r}")
        seen[task.id] = directory
        tasks.append(task)
    return tasks


def load_harbor_tasks(
    path: str | os.PathLike[str], *, build: bool = True, max_turns: int = 100
) -> list[Task]:
    """Harbor tasks as rollbox Tasks (their templates built on the local backend, once).

    The instruction is the first observation; the verifier runs ``tests/test.sh`` after the
    episode and reads the reward file as Harbor does.
    """
    return [t.to_task(build=build, max_turns=max_turns) for t in read_harbor_tasks(path)]


# -- verification ----------------------------------------------------------------------------------


async def _fresh_directory(sandbox: AsyncSandbox, path: str) -> str | None:
    """Make ``path`` an empty directory of the sandbox user; why not, if it could not."""
    quoted = shlex.quote(path)
    command = (
        # replace it where the sandbox may (a link the agent left goes too), else empty it
        f"rm -rf -- {quoted} 2>/dev/null; mkdir -p -- {quoted} && "
        f"find {quoted} -mindepth 1 -maxdepth 1 -exec rm -rf -- {{}} + && "
        f"[ -d {quoted} ] && [ ! -L {quoted} ]"
    )
    try:
        result = await sandbox.commands.run(command, cwd="/", timeout_seconds=60)
    except CommandError as exc:
        return f"could not prepare {path}: {exc}"
    if not result.ok:
        return f"could not prepare {path}: {(result.stderr or result.stdout).strip()[-300:]}"
    return None


async def _upload(
    sandbox: AsyncSandbox, directory: str, files: Mapping[str, TaskFile]
) -> str | None:
    problem = await _fresh_directory(sandbox, directory)
    if problem is not None:
        return problem
    try:
        for relative, file in files.items():
            await sandbox.files.write(
                posixpath.join(directory, relative), file.content, mode=file.mode
            )
    except SandboxFileError as exc:  # e.g. the agent filled the sandbox's memory
        return f"could not write {directory}: {exc}"
    return None


async def _tail(sandbox: AsyncSandbox, path: str, limit: int = 2000) -> str:
    try:
        result = await sandbox.commands.run(
            f"tail -c {limit} -- {shlex.quote(path)}", cwd="/", timeout_seconds=30
        )
    except CommandError:
        return ""
    return result.stdout if result.ok else ""


def verifier_home() -> str:
    """A HOME of the verifier's own: the agent's (``/work``) may hold a ``usercustomize.py``, a
    ``.pth`` file or a ``.gitconfig`` that every Python or git the tests start would obey."""
    return f"/tmp/.rollbox-verifier-home-{secrets.token_hex(8)}"


async def verify_harbor(sandbox: AsyncSandbox, task: HarborTask) -> RewardResult:
    """Run the task's tests in ``sandbox`` and read the reward as Harbor does.

    Call it once the agent is done and its processes are killed (``envs.verify.verify`` and
    ``run_rollouts(score_in_agent_sandbox=True)`` do). ``/tests`` is emptied and filled from the
    host, ``/logs/verifier`` emptied, then ``tests/test.sh`` runs from the working directory
    with ``[verifier].env``, a fresh ``HOME`` and ``[verifier].timeout_sec``. A reward file that is missing or
    malformed scores 0.0 with the reason in ``details`` (Harbor records an exception instead).
    """
    from rollbox.rewards import RewardFile, RewardResult, Sample

    problem = await _upload(sandbox, TESTS_DIR, task.tests)
    home = verifier_home()
    problem = problem or await _fresh_directory(sandbox, home)
    if problem is not None:
        return RewardResult.failure(problem, "reward")
    reward = RewardFile(
        f"chmod +x {TEST_SCRIPT}; ({TEST_SCRIPT}) > {TEST_OUTPUT} 2>&1",
        directory=VERIFIER_LOGS_DIR,
        cwd=task.workdir,
        env={"HOME": home, **task.verifier_env},
        timeout_seconds=task.verifier_timeout_seconds,
        name="reward",
    )
    result = await reward.score(Sample(sandbox=sandbox))
    output = await _tail(sandbox, TEST_OUTPUT)
    return result.model_copy(update={"details": {**result.details, "test_output": output}})


class HarborVerifier:
    """A Task verifier: ``verify_harbor`` with the Harbor task it was made for."""

    __name__ = "harbor"

    def __init__(self, task: HarborTask) -> None:
        self.task = task

    async def __call__(self, sandbox: AsyncSandbox, task: Task | None = None) -> RewardResult:
        return await verify_harbor(sandbox, self.task)

    def __repr__(self) -> str:
        return f"<HarborVerifier {self.task.id!r}>"


# -- running task sets: the dataset and the oracle and nop agents ----------------------------------


def _backend(provider: str | Provider) -> Literal["local", "docker"]:
    name = provider if isinstance(provider, str) else getattr(provider, "name", "")
    return "docker" if name == "docker" else "local"


class HarborDataset:
    """Harbor tasks as a ``run_rollouts`` Dataset; score in the agent's sandbox.

    Harbor verifies the final state of the agent's container, so run it with
    ``run_rollouts(..., score_in_agent_sandbox=True)`` (``rollbox run --harbor`` does).

    Args:
        source: a task directory, a folder of them, or HarborTasks.
        provider: the provider the sandboxes come from (``docker`` uses the images as they are).
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[HarborTask],
        *,
        provider: str | Provider = "local",
    ) -> None:
        self.backend = _backend(provider)
        if isinstance(source, str | os.PathLike):
            self.tasks = read_harbor_tasks(source, backend=self.backend)
        else:
            self.tasks = list(source)

    def instances(self) -> list[HarborTask]:
        return self.tasks

    def instance_id(self, task: HarborTask) -> str:
        return task.id

    def template(self, task: HarborTask) -> SandboxSpec:
        return SandboxSpec(
            name=task.id[:128],
            template=task.template(self.backend),
            limits=task.limits,
            network=task.network,
            env_vars=task.env_vars,
            ttl_seconds=task.ttl_seconds,
        )

    async def setup(self, sandbox: AsyncSandbox, task: HarborTask) -> bool:
        for path, file in task.environment_files().items():
            await sandbox.files.write(path, file.content, mode=file.mode)
        health = task.healthcheck_command()
        if health is not None:
            result = await sandbox.commands.run(health, cwd=task.workdir, timeout_seconds=None)
            if not result.ok:
                raise ConfigError(
                    f"task {task.id!r}: the healthcheck failed: {result.stderr[-500:]}"
                )
        return True

    async def score(self, sandbox: AsyncSandbox, task: HarborTask, patch: str) -> RewardResult:
        return await verify_harbor(sandbox, task)


class OracleAgent:
    """Harbor's ``oracle``: runs the task's ``solution/solve.sh``, as Harbor runs it.

    The solution is written to ``/solution`` only now (the agent's turn), runs from the working
    directory with ``[solution].env`` under ``[agent].timeout_sec``; its output goes to
    ``/logs/agent/oracle.txt``. A task whose oracle does not score 1.0 is a broken task.
    """

    name = "oracle"

    async def solve(
        self, sandbox: AsyncSandbox, instance: HarborTask, *, model: str | None = None
    ) -> AgentResult:
        from rollbox.runner import AgentResult

        if "solve.sh" not in instance.solution:
            raise ConfigError(f"task {instance.id!r}: no solution/solve.sh for the oracle to run")
        problem = await _upload(sandbox, SOLUTION_DIR, instance.solution)
        if problem is not None:
            raise ConfigError(f"task {instance.id!r}: {problem}")
        result = await sandbox.commands.run(
            f"mkdir -p {AGENT_LOGS_DIR}; chmod +x {SOLVE_SCRIPT}; "
            f"({SOLVE_SCRIPT}) > {ORACLE_OUTPUT} 2>&1",
            cwd=instance.workdir,
            env={**instance.solution_env, "DEBIAN_FRONTEND": "noninteractive"},
            timeout_seconds=instance.agent_timeout_seconds,
        )
        output = await _tail(sandbox, ORACLE_OUTPUT)
        if result.timed_out:
            exit = "timeout"
        else:
            exit = "completed" if result.exit_code == 0 else f"exit {result.exit_code}"
        return AgentResult(exit=exit, metadata={"output": output})


class NopAgent:
    """Harbor's ``nop``: does nothing. A task that scores above 0 with it is a broken task."""

    name = "nop"

    async def solve(
        self, sandbox: AsyncSandbox, instance: HarborTask, *, model: str | None = None
    ) -> AgentResult:
        from rollbox.runner import AgentResult

        return AgentResult(exit="nop")


def harbor_agent(name: str) -> OracleAgent | NopAgent:
    """Harbor's validation agents by name: ``oracle`` or ``nop``."""
    agents = {"oracle": OracleAgent, "nop": NopAgent}
    if name not in agents:
        raise ConfigError(f"unknown Harbor agent {name!r}; rollbox has 'oracle' and 'nop'")
    return agents[name]()


def validation_problems(rollouts: Iterable[Any], agent: str) -> list[str]:
    """What a run of ``oracle`` (every task must score 1.0) or ``nop`` (0.0) says is broken."""
    want = {"oracle": 1.0, "nop": 0.0}[agent]
    problems = []
    for rollout in rollouts:
        if rollout.error is not None or rollout.score == want:
            continue  # errors are reported as errors
        why = (
            "the tests fail with the reference solution"
            if agent == "oracle"
            else ("the tests pass without any work")
        )
        reason = (rollout.details.get("details") or {}).get("error")
        problems.append(
            f"task {rollout.instance_id}: {agent} scored {rollout.score}, not {want}: {why}"
            + (f" ({reason})" if reason else "")
        )
    return problems


__all__ = [
    "DEFAULT_LIMITS",
    "HarborDataset",
    "HarborImage",
    "HarborTask",
    "HarborTaskConfig",
    "HarborVerifier",
    "NopAgent",
    "OracleAgent",
    "harbor_agent",
    "harbor_network",
    "image_template",
    "load_harbor_tasks",
    "read_harbor_task",
    "read_harbor_tasks",
    "read_task_config",
    "task_scripts",
    "translate_dockerfile",
    "validation_problems",
    "verify_harbor",
]
