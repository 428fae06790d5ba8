"""HumanEval-layout rows (``prompt``, ``test``, ``entry_point``): the program and the tests."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from rollbox.rewards.base import Column, Sample
from rollbox.rewards.function_tests import PythonTests
from rollbox.rewards.text import defines_function, extract_code


def code_prompt(row: Mapping[str, Any]) -> str | None:
    """The row's HumanEval prompt (code): ``prompt`` if it is text, else the last user message
    of a chat ``prompt`` if that is Python; None otherwise."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        content = users[-1].get("content") if users else None
        if isinstance(content, str):
            try:
                ast.parse(content)
            except SyntaxError:
                return None
            return content
    return None


class PromptColumn(Column):
    """``code_prompt`` of the row, as a reward argument (None when the row has none)."""

    def __init__(self) -> None:
        super().__init__("prompt", None)

    def read(self, sample: Sample, argument: str) -> Any:
        return code_prompt(sample.row)


def humaneval_program(prompt: str | None, completion: str, entry_point: str) -> str:
    """The program a completion makes: a whole function (in a code block or not) follows the
    prompt, whose imports and helpers it may use; anything else continues the prompt."""
    code = extract_code(completion, defines=entry_point)
    if prompt is None:
        return code
    if defines_function(code, entry_point):
        return f"{prompt}\n\n{code}"
    return prompt + code


def humaneval_tests(**options: Any) -> PythonTests:
    """``PythonTests`` reading a HumanEval-layout row: ``test``, ``entry_point``, and the
    prompt as trusted context (some tests call helpers it defines)."""
    options.setdefault("name", "humaneval")
    return PythonTests(
        tests=Column("test"), entry_point=Column("entry_point"), context=PromptColumn(), **options
    )
