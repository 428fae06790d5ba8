"""Reward functions: pure, and sandbox-executed (imported as ``rollbox.rewards``).

A reward scores a ``Sample`` (a sandbox, the model's text, a dataset row) into a
``RewardResult``; every reward is also a Task verifier. Arguments that vary per row are given as
``Column("name")``. Infrastructure failures raise (``INFRASTRUCTURE_ERRORS``); the model's
failures score 0.0 with the reason in ``details``.
"""

from rollbox.rewards.base import INFRASTRUCTURE_ERRORS, Column, Reward, Sample
from rollbox.rewards.commands import ExitCode, OutputMatch, exit_code, json_equal, output_match
from rollbox.rewards.composite import AllOf, Weighted, all_of, weighted
from rollbox.rewards.function_tests import PythonTests, python_tests
from rollbox.rewards.harbor import RewardFile, reward_file
from rollbox.rewards.humaneval import code_prompt, humaneval_program, humaneval_tests
from rollbox.rewards.pytest_report import PytestSuite, pytest_suite
from rollbox.rewards.result import RewardResult
from rollbox.rewards.scoring import score_program, score_programs
from rollbox.rewards.text import (
    CodeBlock,
    LengthBudget,
    code_blocks,
    completion_text,
    extract_code,
    has_code_block,
    length_budget,
)

__all__ = [
    "INFRASTRUCTURE_ERRORS",
    "AllOf",
    "CodeBlock",
    "Column",
    "ExitCode",
    "LengthBudget",
    "OutputMatch",
    "PytestSuite",
    "PythonTests",
    "Reward",
    "RewardFile",
    "RewardResult",
    "Sample",
    "Weighted",
    "all_of",
    "code_blocks",
    "code_prompt",
    "completion_text",
    "exit_code",
    "extract_code",
    "has_code_block",
    "humaneval_program",
    "humaneval_tests",
    "json_equal",
    "length_budget",
    "output_match",
    "pytest_suite",
    "python_tests",
    "reward_file",
    "score_program",
    "score_programs",
    "weighted",
]
