"""Code extraction and format rewards: pure text, no sandbox."""

from __future__ import annotations

import pytest

from rollbox.errors import ConfigError
from rollbox.rewards import (
    CodeBlock,
    LengthBudget,
    Sample,
    code_blocks,
    completion_text,
    extract_code,
    humaneval_program,
)


def test_extract_code_takes_the_last_python_block() -> None:
    text = (
        "Plan:\n```bash\nls\n```\nFirst try:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\n"
    )
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nuntagged = True\n```") == "untagged = True\n"
    assert extract_code("no fences at all\n    return 1\n") == "no fences at all\n    return 1\n"
    assert extract_code("```sh\necho hi\n```") == "echo hi\n"  # no python block: any block
    # a generation cut off inside its block still yields the code
    assert extract_code("Here:\n```python\ndef f():\n    return 1") == "def f():\n    return 1"


def test_extract_code_prefers_the_block_that_defines_the_function() -> None:
    text = "```python\ndef f():\n    return 1\n```\nUsage:\n```python\nprint(f())\n```"
    assert extract_code(text, defines="f") == "def f():\n    return 1\n"
    assert code_blocks(text) == [("python", "def f():\n    return 1\n"), ("python", "print(f())\n")]


def test_completion_text_reads_standard_and_conversational_completions() -> None:
    assert completion_text("plain") == "plain"
    chat = [
        {"role": "assistant", "content": "one"},
        {"role": "tool", "name": "bash", "content": "output"},
        {"role": "assistant", "content": [{"type": "text", "text": "two"}]},
    ]
    assert completion_text(chat) == "one\ntwo"
    with pytest.raises(ConfigError, match="text or a list of chat messages"):
        completion_text(42)


def test_humaneval_program_continues_the_prompt_or_takes_a_whole_function() -> None:
    prompt = 'from typing import List\n\ndef f(xs: List[int]) -> int:\n    """Sum."""\n'
    assert humaneval_program(prompt, "    return sum(xs)\n", "f") == prompt + "    return sum(xs)\n"
    whole = "```python\ndef f(xs: List[int]) -> int:\n    return sum(xs)\n```"
    program = humaneval_program(prompt, whole, "f")
    assert program.startswith(prompt) and program.endswith("    return sum(xs)\n")
    namespace: dict = {}
    exec(program, namespace)  # the prompt's imports serve the whole function
    assert namespace["f"]([1, 2]) == 3


async def test_code_block_reward() -> None:
    reward = CodeBlock()
    assert (await reward.score(Sample(completion="```python\nx\n```"))).score == 1.0
    assert (await reward.score(Sample(completion="```python\nx  (never closed)"))).score == 0.0
    assert (await reward.score(Sample(completion="x = 1"))).score == 0.0
    python_only = CodeBlock("python")
    assert (await python_only.score(Sample(completion="```bash\nls\n```"))).score == 0.0
    assert (await python_only.score(Sample(completion="```py\nx\n```"))).components == {
        "code_block": 1.0
    }


async def test_length_budget_reward() -> None:
    soft, hard = LengthBudget(10), LengthBudget(10, hard=True, name="short")
    assert (await soft.score(Sample(completion="x" * 10))).score == 1.0
    assert (await soft.score(Sample(completion="x" * 15))).score == 0.5
    assert (await soft.score(Sample(completion="x" * 40))).score == 0.0
    result = await hard.score(Sample(completion="x" * 11))
    assert result.score == 0.0 and result.components == {"short": 0.0}
    with pytest.raises(ConfigError, match="max_chars must be a positive int"):
        LengthBudget(0)


async def test_text_rewards_need_text() -> None:
    with pytest.raises(ConfigError, match="scores the model's text"):
        await CodeBlock().score(Sample())
