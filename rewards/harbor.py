"""reward_file: a Harbor-style verifier that writes its reward to a file."""

from __future__ import annotations

import json
import math
import posixpath
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rollbox.errors import CommandError, ConfigError, SandboxFileError
from rollbox.rewards.base import Column, Reward, Sample, check_name, resolve
from rollbox.rewards.result import RewardResult

if TYPE_CHECKING:
    from rollbox.envs.task import TaskFile

HARBOR_DIRECTORY = "/logs/verifier"
_FILE_LIMIT = 1024 * 1024


class RewardFile(Reward):
    """Read the reward that a verifier wrote: ``reward.json``, else ``reward.txt``.

    ``reward.json`` is a JSON object of named numbers (``{"reward": 0.5, "style": 1}``): the
    score is ``"reward"``, or the only value; every value becomes a component. ``reward.txt``
    holds one number.

    Before ``command`` runs (with the hidden ``files`` in a fresh ``$TESTS_DIR``, and
    ``$REWARD_DIR`` set to ``directory``), the directory is emptied, so a reward file that the
    agent wrote in advance counts for nothing. Harbor tasks write to ``/logs/verifier``; on a
    template whose root is read-only (the ``python`` template: only ``/work`` and ``/tmp`` are
    writable) give ``directory="/tmp/logs/verifier"`` and have the verifier write to
    ``$REWARD_DIR``. Without ``command`` the files are read as they are (a verifier that ran
    earlier wrote them).
    """

    def __init__(
        self,
        command: str | Column | None = None,
        *,
        files: Mapping[str, str | bytes | TaskFile] | Column | None = None,
        directory: str = HARBOR_DIRECTORY,
        cwd: str = "/work",
        env: Mapping[str, str] | None = None,
        timeout_seconds: float = 600.0,
        name: str | None = None,
    ) -> None:
        if not isinstance(directory, str) or not posixpath.isabs(directory) or directory == "/":
            raise ConfigError(f"RewardFile: directory must be an absolute path, not {directory!r}")
        if not (
            isinstance(timeout_seconds, int | float)
            and math.isfinite(timeout_seconds)
            and timeout_seconds > 0
        ):
            raise ConfigError(
                f"RewardFile: timeout_seconds must be positive, not {timeout_seconds!r}"
            )
        if command is None and files is not None:
            raise ConfigError("RewardFile: hidden files need a command to run them")
        self.command = command
        self.files = files
        self.directory = posixpath.normpath(directory)
        self.cwd = cwd
        self.env = dict(env or {})
        self.timeout_seconds = float(timeout_seconds)
        self.name = check_name(name, "reward_file")

    async def score(self, sample: Sample) -> RewardResult:
        from rollbox.envs.task import TestsVerifier  # on use: envs imports this package
        from rollbox.envs.verify import run_tests

        sandbox = sample.need_sandbox(self)
        details: dict[str, Any] = {}
        command = resolve(self.command, sample, "command")
        if command is not None:
            quoted = shlex.quote(self.directory)
            try:
                cleared = await sandbox.commands.run(
                    f"rm -rf -- {quoted} && mkdir -p -- {quoted}", cwd="/", timeout_seconds=30
                )
            except CommandError as exc:
                return RewardResult.failure(f"could not prepare {self.directory}: {exc}", self.name)
            if not cleared.ok:
                if "Read-only file system" in cleared.stderr:
                    raise ConfigError(
                        f"RewardFile: {self.directory} is on the template's read-only root; "
                        'use a writable directory, e.g. directory="/tmp/logs/verifier", and '
                        "have the verifier write to $REWARD_DIR"
                    )
                return RewardResult.failure(
                    f"could not prepare {self.directory}: {cleared.stderr.strip()}", self.name
                )
            verifier = TestsVerifier(
                command=command,
                files=resolve(self.files, sample, "files") or {},
                cwd=self.cwd,
                env={"REWARD_DIR": self.directory, **self.env},
                timeout_seconds=self.timeout_seconds,
            )
            ran = await run_tests(sandbox, verifier)
            details.update(ran.details)
        for filename, parse in (("reward.json", _from_json), ("reward.txt", _from_text)):
            text = await _read(sandbox, posixpath.join(self.directory, filename))
            if text is None:
                continue
            parsed = parse(text)
            if isinstance(parsed, str):
                return RewardResult.failure(f"{filename}: {parsed}", self.name, **details)
            score, components = parsed
            details["file"] = filename
            return RewardResult(
                score=score, components={self.name: score, **components}, details=details
            )
        return RewardResult.failure(
            f"the verifier wrote neither reward.json nor reward.txt in {self.directory}",
            self.name,
            **details,
        )


async def _read(sandbox: Any, path: str) -> str | None:
    directory, name = posixpath.split(path)
    try:
        entries = await sandbox.files.list(directory)
    except SandboxFileError:
        return None
    entry = next((e for e in entries if e.name == name), None)
    if entry is None:
        return None
    if entry.type != "file" or entry.size > _FILE_LIMIT:
        return ""  # a symlink, a directory or a huge file: garbage, not missing
    try:
        return (await sandbox.files.read(path)).decode("utf-8", errors="replace")
    except SandboxFileError:
        return ""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _from_json(text: str) -> tuple[float, dict[str, float]] | str:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return "not valid JSON"
    if not isinstance(data, dict) or not data:
        return "not a JSON object of named rewards"
    components = {}
    for key, value in data.items():
        number = _number(value)
        if number is None:
            return f"{key!r} is not a finite number"
        components[key] = number
    if "reward" in components:
        return components["reward"], components
    if len(components) == 1:
        return next(iter(components.values())), components
    return "several rewards and none named 'reward'"


def _from_text(text: str) -> tuple[float, dict[str, float]] | str:
    try:
        number = _number(float(text.strip()))
    except ValueError:
        number = None
    if number is None:
        return f"{text.strip()[:40]!r} is not a number"
    return number, {}


reward_file = RewardFile
