"""The model's text: code extracted from markdown, and format rewards (no sandbox needed)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from rollbox.errors import ConfigError
from rollbox.rewards.base import Reward, Sample, check_name
from rollbox.rewards.result import RewardResult

# A fenced block: ```lang ... ``` (or ~~~), the closing fence alone on its line.
_FENCE = re.compile(
    r"^[ \t]*(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+#.-]*)[^\n]*\n(?P<body>.*?)^[ \t]*(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_OPEN_FENCE = re.compile(
    r"^[ \t]*(?:`{3,}|~{3,})[ \t]*(?P<lang>[\w+#.-]*)[^\n]*\n(?P<body>.*)\Z", re.M | re.S
)
_ALIASES = {"python": {"python", "py", "python3", "py3"}}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block as ``(language, body)``; a last block left open (a truncated
    generation) counts too."""
    blocks = []
    end = 0
    for match in _FENCE.finditer(text):
        blocks.append((match["lang"].lower(), match["body"]))
        end = match.end()
    tail = _OPEN_FENCE.search(text, end)
    if tail is not None:
        blocks.append((tail["lang"].lower(), tail["body"]))
    return blocks


def extract_code(text: str, language: str = "python", *, defines: str | None = None) -> str:
    """The program in a model's answer: the last fenced block in ``language`` (or untagged),
    preferring one that defines the function ``defines``; the text itself if it has no fence."""
    blocks = code_blocks(text)
    if not blocks:
        return text
    names = _ALIASES.get(language, {language})
    fitting = [body for lang, body in blocks if lang in names] or [
        body for lang, body in blocks if not lang
    ]
    fitting = fitting or [body for _, body in blocks]
    if defines is not None:
        defining = [body for body in fitting if defines_function(body, defines)]
        fitting = defining or fitting
    return fitting[-1]


def defines_function(code: str, name: str) -> bool:
    """Whether ``code`` defines ``name`` at the top level (``def name(`` at column 0)."""
    return (
        re.search(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", code, re.M) is not None
    )


def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a string, or the assistant messages of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    if isinstance(completion, Sequence):
        parts = []
        for message in completion:
            if isinstance(message, Mapping) and message.get("role", "assistant") == "assistant":
                parts.append(_content_text(message.get("content")))
        return "\n".join(part for part in parts if part)
    raise ConfigError(
        f"a completion is text or a list of chat messages, not {type(completion).__name__}"
    )


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return str(content)


class CodeBlock(Reward):
    """1.0 if the text holds a closed fenced code block (in ``language``, if given), else 0.0."""

    uses_sandbox = False

    def __init__(self, language: str | None = None, *, name: str | None = None) -> None:
        self.language = language.lower() if language else None
        self.name = check_name(name, "code_block")

    async def score(self, sample: Sample) -> RewardResult:
        text = sample.need_text(self)
        names = _ALIASES.get(self.language, {self.language}) if self.language else None
        found = any(names is None or m["lang"].lower() in names for m in _FENCE.finditer(text))
        score = float(found)
        return RewardResult(score=score, components={self.name: score})


class LengthBudget(Reward):
    """1.0 within ``max_chars`` characters; beyond, linearly down to 0.0 at twice the budget
    (or 0.0 at once with ``hard=True``)."""

    uses_sandbox = False

    def __init__(self, max_chars: int, *, hard: bool = False, name: str | None = None) -> None:
        if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars <= 0:
            raise ConfigError(f"LengthBudget: max_chars must be a positive int, not {max_chars!r}")
        self.max_chars = max_chars
        self.hard = hard
        self.name = check_name(name, "length")

    async def score(self, sample: Sample) -> RewardResult:
        length = len(sample.need_text(self))
        over = max(0, length - self.max_chars)
        if over == 0:
            score = 1.0
        elif self.hard:
            score = 0.0
        else:
            score = max(0.0, 1.0 - over / self.max_chars)
        return RewardResult(score=score, components={self.name: score}, details={"chars": length})


has_code_block = CodeBlock
length_budget = LengthBudget
