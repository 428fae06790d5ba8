"""The provider layer: sandboxes and the backends that run them."""

from rollbox.sandbox.base import AsyncProcess, AsyncSandbox, Provider
from rollbox.sandbox.models import (
    ExecResult,
    FileEntry,
    Limits,
    NetworkConfig,
    SandboxInfo,
    SandboxSpec,
)
from rollbox.sandbox.registry import get_provider, provider_names
from rollbox.sandbox.sync import Sandbox, SyncProcess

__all__ = [
    "AsyncProcess",
    "AsyncSandbox",
    "ExecResult",
    "FileEntry",
    "Limits",
    "NetworkConfig",
    "Provider",
    "Sandbox",
    "SandboxInfo",
    "SandboxSpec",
    "SyncProcess",
    "get_provider",
    "provider_names",
]
