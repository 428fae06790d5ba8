"""What an agent may do in one step: a shell command, or a tool call."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from rollbox.errors import ConfigError

TOOLS_HELP = (
    'tools: {"tool": "bash", "command": ...}, {"tool": "write_file", "path": ..., '
    '"content": ...}, {"tool": "read_file", "path": ...}, {"tool": "submit"}'
)


class _Call(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Bash(_Call):
    """Run a shell command (``/bin/sh -c``) in ``/work``."""

    tool: Literal["bash"] = "bash"
    command: str


class WriteFile(_Call):
    """Write a text file (relative paths are under ``/work``)."""

    tool: Literal["write_file"] = "write_file"
    path: str
    content: str


class ReadFile(_Call):
    """Read a text file."""

    tool: Literal["read_file"] = "read_file"
    path: str


class Submit(_Call):
    """End the episode: the verifier scores the sandbox as it is."""

    tool: Literal["submit"] = "submit"


ToolCall = Annotated[Bash | WriteFile | ReadFile | Submit, Field(discriminator="tool")]
_TOOL_CALL: TypeAdapter[Bash | WriteFile | ReadFile | Submit] = TypeAdapter(ToolCall)


class InvalidAction(BaseModel):
    """An action the agent got wrong; it costs a turn and the agent is told why."""

    model_config = ConfigDict(frozen=True)

    tool: Literal["invalid"] = "invalid"
    reason: str


Action = Bash | WriteFile | ReadFile | Submit | InvalidAction


def parse_action(action: object) -> Action:
    """Turn what the agent sent into an action.

    Text is a shell command, unless it is a JSON object with a ``"tool"`` key (so agents limited
    to a Text action space can still call tools). A mapping is a tool call. A malformed tool
    call is the agent's mistake and becomes an :class:`InvalidAction`.

    Raises:
        ConfigError: ``action`` is neither text, a mapping nor a tool call model (a bug in the
            calling code, not the agent's choice).
    """
    if isinstance(action, Bash | WriteFile | ReadFile | Submit | InvalidAction):
        return action
    if isinstance(action, bytes):
        action = action.decode(errors="replace")
    if isinstance(action, str):
        stripped = action.strip()
        if stripped.startswith("{") and '"tool"' in stripped:
            try:
                decoded = json.loads(stripped)
            except json.JSONDecodeError:
                decoded = None
            if isinstance(decoded, dict) and "tool" in decoded:
                return _tool_call(decoded)
        return Bash(command=action)
    if isinstance(action, Mapping):
        return _tool_call(action)
    raise ConfigError(
        f"an action is a shell command (str) or a tool call (dict), not {type(action).__name__}"
    )


def _tool_call(data: Mapping[object, object]) -> Action:
    tool = data.get("tool")
    if tool not in ("bash", "write_file", "read_file", "submit"):
        what = "no tool named" if "tool" not in data else f"unknown tool {tool!r}"
        return InvalidAction(reason=f"invalid tool call: {what}; {TOOLS_HELP}")
    try:
        return _TOOL_CALL.validate_python(dict(data))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'][1:]) or 'tool'}: {error['msg']}"
            for error in exc.errors()
        )
        return InvalidAction(reason=f"invalid tool call ({problems}); {TOOLS_HELP}")
