"""rollbox: agent evaluations and RL rollouts with every trial in its own sandbox."""

from rollbox.errors import (
    BackendUnavailableError,
    CommandError,
    ConfigError,
    RollboxError,
    SandboxDeadError,
    SandboxError,
    SandboxFileError,
    SandboxStartError,
    TaskSetupError,
    TemplateBuildError,
    TooManySandboxesError,
)
from rollbox.sandbox import (
    AsyncProcess,
    AsyncSandbox,
    ExecResult,
    FileEntry,
    Limits,
    NetworkConfig,
    Provider,
    Sandbox,
    SandboxInfo,
    Snapshot,
    SyncProcess,
    Template,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncProcess",
    "AsyncSandbox",
    "BackendUnavailableError",
    "CommandError",
    "ConfigError",
    "ExecResult",
    "FileEntry",
    "Limits",
    "NetworkConfig",
    "Provider",
    "RollboxError",
    "Sandbox",
    "SandboxDeadError",
    "SandboxError",
    "SandboxFileError",
    "SandboxInfo",
    "SandboxStartError",
    "Snapshot",
    "SyncProcess",
    "TaskSetupError",
    "Template",
    "TemplateBuildError",
    "TooManySandboxesError",
    "__version__",
]
