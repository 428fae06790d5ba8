"""Pydantic models of the sandbox API; the HTTP wire schema uses the same ones."""

from __future__ import annotations

import ipaddress
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollbox.sandbox.templates import Template


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Limits(_Model):
    """Resource limits of one sandbox; each is enforced by the backend."""

    memory_mb: int = Field(512, gt=0, description="memory of all processes, tmpfs files included")
    pids: int = Field(256, gt=0, description="processes and threads at once")
    cpus: float = Field(1.0, gt=0, description="CPU share, in cores")
    disk_mb: int = Field(
        1024, gt=0, description="size of each writable mount (/work, /tmp) and of any one file"
    )
    output_bytes: int = Field(
        1_000_000, ge=0, description="stdout and stderr kept per command, each"
    )


class NetworkConfig(_Model):
    """Outbound network policy. The default, and any config without ``allow_out``, is no network.

    ``allow_out`` and ``deny_out`` hold CIDRs (``10.0.0.0/8``), addresses, or either with a
    port (``10.0.0.5:8080``). Deny wins over allow.
    """

    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()

    @field_validator("allow_out", "deny_out", mode="before")
    @classmethod
    def _check_rules(cls, rules: object) -> object:
        if isinstance(rules, str):
            raise ValueError("give a list of CIDRs, not one string")
        for rule in rules or ():  # type: ignore[union-attr]
            parse_network_rule(rule)
        return tuple(rules or ())  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        """Whether the sandbox gets any network beyond its own loopback."""
        return bool(self.allow_out)


def parse_network_rule(
    rule: str,
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]:
    """Split ``CIDR[:port]`` into a network and an optional port; raise ValueError if malformed."""
    if not isinstance(rule, str) or not rule:
        raise ValueError(f"network rule {rule!r} is not a CIDR string")
    port: int | None = None
    address = rule
    if rule.count(":") == 1:  # IPv4 with a port; IPv6 rules carry no port
        address, _, port_text = rule.partition(":")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"network rule {rule!r}: port must be 1-65535")
        port = int(port_text)
    try:
        network = ipaddress.ip_network(address, strict=False)
    except ValueError as exc:
        raise ValueError(
            f"network rule {rule!r} is not a CIDR such as 10.0.0.0/8 or 1.2.3.4:443"
        ) from exc
    return network, port


class Snapshot(_Model):
    """The filesystem state of a sandbox, captured by ``sandbox.snapshot()``.

    ``AsyncSandbox.create(from_snapshot=snap)`` starts any number of sandboxes from it. It lives
    until ``delete_snapshot``, or until the process that made it exits (a crashed one's are
    removed by ``rollbox cleanup`` and when a provider starts).
    """

    id: str
    provider: str
    template: str | Template = Field(description="the template of the sandbox it was taken of")
    template_id: str
    source_sandbox: str
    created_at: datetime
    size_bytes: int = Field(description="bytes of file data it holds")
    ref: str = Field(description="where the provider keeps it: a directory, an image id")


class SandboxSpec(_Model):
    """Everything that defines a sandbox to create."""

    name: str | None = Field(None, max_length=128)
    template: str | Template = "python"
    snapshot: Snapshot | None = None
    network: NetworkConfig = NetworkConfig()
    limits: Limits = Limits()
    env_vars: dict[str, str] = Field(default_factory=dict)
    ttl_seconds: float | None = Field(3600.0, gt=0)

    @field_validator("env_vars")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"environment variable name {key!r} is invalid")
        return env


class ExecResult(_Model):
    """What a finished command did. A non-zero exit is a result, not an error."""

    exit_code: int = Field(
        description="the exit status; -N if killed by signal N (a timeout is -9)"
    )
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = Field(False, description="output beyond Limits.output_bytes was dropped")
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class FileEntry(_Model):
    """One entry of a directory listing; symlinks are reported, never followed."""

    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class SandboxInfo(_Model):
    """A live sandbox as a provider lists it."""

    id: str
    name: str | None
    provider: str
    template: str
    template_id: str
    created_at: datetime
    expires_at: datetime | None
    snapshot: str | None = Field(None, description="the id of the snapshot it started from")
