"""Text that a model reads: the observation charset, its gymnasium space, and output formatting."""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
from gymnasium.spaces import Text

from rollbox.sandbox.models import ExecResult

REPLACEMENT = "\ufffd"
TRUNCATION_MARK = "[... {count} characters truncated ...]"


@functools.cache
def _tables() -> tuple[frozenset[str], tuple[str, ...], dict[str, np.int32], str, np.ndarray]:
    """The charset, built once: every printable character of the Basic Multilingual Plane."""
    chars = sorted({"\n", "\t"} | {c for i in range(0x10000) if (c := chr(i)).isprintable()})
    index = {c: np.int32(i) for i, c in enumerate(chars)}
    return frozenset(chars), tuple(chars), index, "".join(chars), np.array(chars)


def charset() -> frozenset[str]:
    """Every character an observation or a Text action may hold: printable BMP, newline, tab."""
    return _tables()[0]


@functools.cache
def _outside_charset() -> re.Pattern[str]:
    codes = [ord(c) for c in _tables()[1]]
    ranges = []
    start = previous = codes[0]
    for code in codes[1:]:
        if code != previous + 1:
            ranges.append((start, previous))
            start = code
        previous = code
    ranges.append((start, previous))
    body = "".join(
        re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
        for a, b in ranges
    )
    return re.compile(f"[^{body}]")


_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


def sanitize(text: str) -> str:
    """Make ``text`` fit the charset: strip terminal escapes, turn ``\\r`` into newlines, and
    replace any other character outside it with U+FFFD."""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _outside_charset().sub(REPLACEMENT, text)


def clip(text: str, limit: int) -> str:
    """Keep at most about ``limit`` characters: the head and the tail, with a mark between."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    dropped = len(text) - head - tail
    mark = TRUNCATION_MARK.format(count=f"{dropped:,}")
    return f"{text[:head]}\n{mark}\n{text[len(text) - tail :]}"


def format_exec(result: ExecResult, *, max_chars: int, output_cap: int | None = None) -> str:
    """A command's result as a model reads it: exit code, time taken, stdout and stderr."""
    status = f"exit code: {result.exit_code} ({result.duration_s:.2f} s)"
    if result.timed_out:
        status += " - timed out: the command and every process it started were killed"
    parts = [status]
    for name, stream in (("stdout", result.stdout), ("stderr", result.stderr)):
        if stream:
            text = clip(sanitize(stream), max_chars)
            parts.append(f"--- {name} ---\n{text.removesuffix(chr(10))}")
    if result.truncated:
        cap = f" of {output_cap:,} bytes" if output_cap else ""
        parts.append(f"[output beyond the sandbox's cap{cap} per stream was dropped]")
    if not result.stdout and not result.stderr:
        parts.append("(no output)")
    return "\n".join(parts)


class PrintableText(Text):
    """``gymnasium.spaces.Text`` over :func:`charset`, with ``min_length=0``.

    The charset has ~55,000 characters; its tables are built once and shared by every instance
    (and left out of pickles and deep copies), so hundreds of environments stay cheap.
    """

    def __init__(
        self, max_length: int, *, min_length: int = 0, seed: int | np.random.Generator | None = None
    ) -> None:
        if not 0 <= min_length <= max_length:
            raise ValueError(f"need 0 <= min_length <= max_length, got {min_length}, {max_length}")
        self.min_length = int(min_length)
        self.max_length = int(max_length)
        self._share_tables()
        super(Text, self).__init__(dtype=str, seed=seed)

    def _share_tables(self) -> None:
        self._char_set, self._char_list, self._char_index, self._char_str, self._char_array = (
            _tables()
        )

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is not None or probability is not None:
            return super().sample(mask=mask, probability=probability)
        # uniform over the charset, without building a 55,000-entry probability vector each time
        length = int(self.np_random.integers(self.min_length, self.max_length + 1))
        picks = self.np_random.integers(0, len(self._char_list), size=length)
        return "".join(self._char_array[picks].tolist())

    def __repr__(self) -> str:
        return f"PrintableText({self.min_length}, {self.max_length})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_char_set", "_char_list", "_char_index", "_char_str", "_char_array"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        self._share_tables()
