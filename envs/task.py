"""Task: what one multi-turn episode is, loadable from Python, a task directory or JSONL rows."""

from __future__ import annotations

import json
import os
import posixpath
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rollbox.errors import ConfigError
from rollbox.sandbox.models import Limits, NetworkConfig

# A verifier callable: ``(sandbox, task) -> float | RewardResult`` (or an awaitable of one).
VerifierFn = Callable[..., Any]
# A shaping callable: ``(sandbox, task, info) -> float`` (or an awaitable of one).
ShapingFn = Callable[..., Any]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(describe_errors(f"invalid {type(self).__name__}", exc)) from exc


class TaskFile(_Model):
    """A file to place in the sandbox; a plain ``str`` or ``bytes`` is its content (mode 0644)."""

    content: str | bytes
    mode: int = Field(0o644, ge=0, le=0o7777)


def _files(value: object, *, hidden: bool) -> object:
    if not isinstance(value, Mapping):
        return value
    files = {}
    for path, content in value.items():
        if not isinstance(path, str) or not path or "\0" in path:
            raise ValueError(f"file path {path!r} must be a non-empty string without NUL bytes")
        if hidden:
            normal = posixpath.normpath(path)
            if posixpath.isabs(path) or normal == ".." or normal.startswith("../"):
                raise ValueError(
                    f"hidden file path {path!r} must be relative (it lands under $TESTS_DIR)"
                )
        files[path] = (
            {"content": content} if isinstance(content, str | bytes | bytearray) else content
        )
    return files


class TestsVerifier(_Model):
    """Score the final state with a test command: reward 1.0 if it exits 0, else 0.0.

    ``files`` are the hidden tests. They are uploaded only after the agent's last step, once
    every process the agent left running is killed, to a fresh directory under ``/tmp`` that the
    command sees as ``$TESTS_DIR`` (and, unless ``cwd`` says otherwise, runs in).

    With ``stdin_nonce=True`` the command gets a random line on stdin and passes only if it also
    prints that line: code under test that exits 0 early (``os._exit(0)``) does not pass.
    """

    __test__ = False  # not a pytest class

    command: str = Field(min_length=1)
    files: dict[str, TaskFile] = Field(default_factory=dict)
    timeout_seconds: float = Field(120.0, gt=0)
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    stdin_nonce: bool = False

    @field_validator("files", mode="before")
    @classmethod
    def _check_files(cls, value: object) -> object:
        return _files(value, hidden=True)


class Task(_Model):
    """One multi-turn task: what the agent is told, the sandbox it works in, how it is scored.

    ``files`` (paths relative to ``/work``, or absolute) are placed and ``setup`` commands run
    before the first observation. The episode ends when the agent submits or ``done_command``
    exits 0 (terminated), or at ``max_turns`` steps or ``episode_timeout_seconds`` of wall time
    (truncated); then the ``verifier`` scores the final state. Without a verifier the final
    reward is 0.0. ``shaping`` (Python only) gives intermediate rewards.
    """

    id: str = Field(min_length=1)
    instruction: str = Field(min_length=1)
    template: str = "python"
    files: dict[str, TaskFile] = Field(default_factory=dict)
    setup: tuple[str, ...] = ()
    setup_timeout_seconds: float = Field(600.0, gt=0)
    env_vars: dict[str, str] = Field(default_factory=dict)
    limits: Limits = Field(default_factory=Limits)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    max_turns: int = Field(30, ge=1)
    step_timeout_seconds: float = Field(60.0, gt=0)
    episode_timeout_seconds: float | None = Field(1800.0, gt=0)
    verifier: TestsVerifier | VerifierFn | None = None
    done_command: str | None = None
    shaping: ShapingFn | None = Field(None, exclude=True)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("files", mode="before")
    @classmethod
    def _check_files(cls, value: object) -> object:
        return _files(value, hidden=False)

    @field_validator("setup", mode="before")
    @classmethod
    def _one_command(cls, value: object) -> object:
        return (value,) if isinstance(value, str) else value

    @field_validator("setup")
    @classmethod
    def _check_setup(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for command in value:
            if not command.strip() or "\0" in command:
                raise ValueError("setup commands must be non-empty strings without NUL bytes")
        return value

    @field_validator("verifier", mode="before")
    @classmethod
    def _check_verifier(cls, value: object) -> object:
        if isinstance(value, Mapping):
            # built here so that a bad table reports its own fields, not a failed union
            return TestsVerifier(**value)
        if value is None or isinstance(value, TestsVerifier):
            return value
        if not callable(value):
            raise ValueError(
                "give a test command ({'command': ..., 'files': {...}}) or a callable "
                "(sandbox, task) -> float"
            )
        return value

    @model_validator(mode="after")
    def _check_done_command(self) -> Task:
        if self.done_command is not None and not self.done_command.strip():
            raise ValueError("done_command must be a non-empty command (or left out)")
        return self

    @property
    def sandbox_ttl_seconds(self) -> float | None:
        """How long the provider lets the sandbox live, whatever happens to this process."""
        if self.episode_timeout_seconds is None:
            return None
        verify = self.verifier.timeout_seconds if isinstance(self.verifier, TestsVerifier) else 0
        setup = self.setup_timeout_seconds * len(self.setup)
        return self.episode_timeout_seconds + setup + verify + 300.0

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Task:
        """Load a task directory: ``task.toml``, ``instruction.md``, ``files/``, ``tests/``.

        ``task.toml`` holds the Task's fields (``id`` defaults to the directory's name) and a
        ``[verifier]`` table (``command``, ``timeout_seconds``, ...); ``files/`` is placed under
        ``/work``; ``tests/`` becomes the verifier's hidden files.

        Raises:
            ConfigError: a missing or malformed file; the message names it and the field.
        """
        root = Path(path)
        manifest = root / "task.toml"
        if not manifest.is_file():
            raise ConfigError(
                f"{root}: no task.toml (a task directory holds task.toml, instruction.md, "
                "files/ and tests/)"
            )
        try:
            data: dict[str, Any] = tomllib.loads(manifest.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{manifest}: {exc}") from exc
        data.setdefault("id", root.name)
        instruction = root / "instruction.md"
        if instruction.is_file():
            if "instruction" in data:
                raise ConfigError(
                    f"{manifest}: instruction is given twice, here and in instruction.md"
                )
            data["instruction"] = instruction.read_text(encoding="utf-8")
        elif "instruction" not in data:
            raise ConfigError(f"{root}: no instruction.md (what the agent is told)")
        if (root / "files").is_dir():
            if "files" in data:
                raise ConfigError(f"{manifest}: files are given twice, here and in files/")
            data["files"] = _read_tree(root / "files")
        tests = root / "tests"
        if tests.is_dir():
            verifier = data.get("verifier")
            if not isinstance(verifier, dict) or "command" not in verifier:
                raise ConfigError(
                    f"{manifest}: tests/ holds hidden tests but there is no [verifier] table "
                    'with a command, e.g.\n[verifier]\ncommand = "python3 -m pytest -q $TESTS_DIR"'
                )
            if "files" in verifier:
                raise ConfigError(f"{manifest}: verifier.files are given twice, here and in tests/")
            verifier["files"] = _read_tree(tests)
        return _validate(data, str(manifest))

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str]) -> list[Task]:
        """Load one task per line of a JSONL file (blank lines are skipped).

        Raises:
            ConfigError: a malformed line or row, or a repeated id; the message names the line.
        """
        source = Path(path)
        tasks: list[Task] = []
        seen: dict[str, int] = {}
        try:
            lines = source.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{source}: cannot read: {exc}") from exc
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{source} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: invalid JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: a row must be a JSON object, not {type(row).__name__}")
            task = _validate(row, where)
            if task.id in seen:
                raise ConfigError(
                    f"{where}: task id {task.id!r} is already used on line {seen[task.id]}"
                )
            seen[task.id] = number
            tasks.append(task)
        return tasks


def load_tasks(path: str | os.PathLike[str]) -> list[Task]:
    """Load tasks from a JSONL file, a task directory, or a directory of task directories."""
    source = Path(path)
    if source.is_file():
        return Task.from_jsonl(source)
    if not source.is_dir():
        raise ConfigError(f"{source}: no such file or directory")
    if (source / "task.toml").is_file():
        return [Task.from_dir(source)]
    tasks = [Task.from_dir(d) for d in sorted(source.iterdir()) if (d / "task.toml").is_file()]
    if not tasks:
        raise ConfigError(f"{source}: no task.toml here nor in any subdirectory")
    return tasks


def task_by_id(tasks: Iterable[Task], task_id: str) -> Task:
    """The task with ``task_id``; ConfigError naming a few known ids if there is none."""
    known = []
    for task in tasks:
        if task.id == task_id:
            return task
        known.append(task.id)
    sample = ", ".join(repr(k) for k in known[:5]) + (", ..." if len(known) > 5 else "")
    raise ConfigError(f"no task with id {task_id!r}; known: {sample or 'none'}")


def describe_errors(prefix: str, exc: ValidationError) -> str:
    """One line per pydantic error, each naming the field."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(task)"
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {message}")
    return f"{prefix}: " + "; ".join(lines)


def _validate(data: dict[str, Any], where: str) -> Task:
    try:
        return Task(**data)
    except ConfigError as exc:  # "invalid Task: field: problem; ..."
        raise ConfigError(f"{where}: {str(exc).removeprefix('invalid Task: ')}") from exc


def _read_tree(root: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``root`` as ``{relative path: {content, mode}}``; text stays text."""
    files: dict[str, dict[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            source = Path(dirpath) / name
            relative = source.relative_to(root).as_posix()
            if source.is_symlink():
                raise ConfigError(f"{source}: symlinks are not supported in a task directory")
            data = source.read_bytes()
            try:
                content: str | bytes = data.decode("utf-8")
            except UnicodeDecodeError:
                content = data
            files[relative] = {"content": content, "mode": source.stat().st_mode & 0o777}
    return files
