"""The provider layer: sandboxes and the backends that run them."""

from rollbox.sandbox.base import AsyncProcess, AsyncSandbox, Provider
from rollbox.sandbox.models import (
    ExecResult,
    FileEntry,
    Limits,
    NetworkConfig,
    SandboxInfo,
    SandboxSpec,
    Snapshot,
)
from rollbox.sandbox.registry import get_provider, provider_names
from rollbox.sandbox.sync import Sandbox, SyncProcess
from rollbox.sandbox.templates import (
    AptStep,
    CopyStep,
    EnvStep,
    PipStep,
    RunStep,
    Template,
    WorkdirStep,
)

__all__ = [
    "AptStep",
    "AsyncProcess",
    "AsyncSandbox",
    "CopyStep",
    "EnvStep",
    "ExecResult",
    "FileEntry",
    "Limits",
    "NetworkConfig",
    "PipStep",
    "Provider",
    "RunStep",
    "Sandbox",
    "SandboxInfo",
    "SandboxSpec",
    "Snapshot",
    "SyncProcess",
    "Template",
    "WorkdirStep",
    "get_provider",
    "provider_names",
]
