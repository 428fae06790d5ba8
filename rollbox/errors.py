"""Every error rollbox raises, under one root.

    RollboxError
    ├── ConfigError                 a bad argument or input file; the message names the field
    ├── BackendUnavailableError     the machine lacks something a backend needs (bwrap, cgroups, ...)
    │   ├── ProviderNotFoundError   an unknown provider name, or its extra is not installed
    │   └── DockerEngineError       the Docker Engine refused a request or cannot be reached
    ├── SandboxError                something went wrong with one sandbox
    │   ├── SandboxStartError       it could not start
    │   ├── SandboxDeadError        it died or was killed (.reason: killed, ttl, oom, exited, node_died)
    │   ├── SandboxFileError        a file operation failed (missing file, not a directory, ...)
    │   ├── TooManySandboxesError   the provider's cap on live sandboxes was reached
    │   └── CommandError            a command could not be started (not: it exited non-zero)
    ├── TaskSetupError              a task's files or setup failed: the task is broken, not the agent
    └── TemplateBuildError          a template step failed; the message names it, with its output

A command that exits non-zero is a result, never an exception.
"""

from __future__ import annotations


class RollboxError(Exception):
    """Root of every rollbox error."""


class ConfigError(RollboxError, ValueError):
    """A bad argument or input; the message names what is wrong and how to fix it."""


class BackendUnavailableError(RollboxError):
    """This machine lacks a feature the backend needs; the message names the fix."""


class ProviderNotFoundError(BackendUnavailableError):
    """No provider by that name, or its optional dependencies are missing."""


class SandboxError(RollboxError):
    """An error about one sandbox."""

    def __init__(self, message: str, *, sandbox_id: str | None = None) -> None:
        super().__init__(message)
        self.sandbox_id = sandbox_id


class SandboxStartError(SandboxError):
    """The sandbox could not start: infrastructure failure, not a policy failure."""


class SandboxDeadError(SandboxError):
    """The sandbox is gone (killed, expired, or its agent died).

    ``reason`` is one of ``"killed"``, ``"ttl"``, ``"oom"`` (its own processes and files used
    up ``Limits.memory_mb``: the policy's doing, which a reward should score as a failure),
    ``"exited"`` (its agent ended for another reason) or ``"node_died"`` (the Ray node, or the
    sandbox host on it, went away: infrastructure, which ``run_rollouts`` runs again elsewhere).
    """

    def __init__(
        self, message: str, *, sandbox_id: str | None = None, reason: str = "killed"
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.reason = reason


class SandboxFileError(SandboxError):
    """A file operation inside the sandbox failed."""


class TooManySandboxesError(SandboxError):
    """The provider's cap on live sandboxes was reached and waiting was not allowed or timed out."""


class CommandError(SandboxError):
    """A command could not be started (bad cwd, ...). Non-zero exits are results, not errors."""


class TemplateBuildError(RollboxError):
    """A template could not be built: the message names the failed step and shows its output."""


class TaskSetupError(RollboxError):
    """A task's files could not be placed or a setup command failed: the task is broken.

    This is never an episode (nor a reward): fix the task. ``output`` holds what setup printed.
    """

    def __init__(
        self, message: str, *, task_id: str, sandbox_id: str | None = None, output: str = ""
    ) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.sandbox_id = sandbox_id
        self.output = output
