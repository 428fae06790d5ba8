"""TRL: sandbox_reward and SandboxToolEnv, alone and inside a real GRPOTrainer (CPU, offline)."""

from __future__ import annotations

import inspect
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="install torch first, then pip install 'rollbox[trl]'")

from trl.trainer.utils import is_async_callable

from rollbox.envs import Task
from rollbox.errors import ConfigError
from rollbox.integrations.trl import SandboxToolEnv, sandbox_reward, task_from_row
from rollbox.rewards import CodeBlock, Column, OutputMatch, Weighted
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.registry import get_provider
from rollbox.sandbox.sync import run_sync
from tests.conftest import assert_no_leftovers
from tests.integrations.conftest import EXAMPLE, TinyLM, humaneval_problem


class Log:
    """Collects what a reward function sends to TRL's log_metric and log_extra."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list[Any]] = {}

    def metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(value)

    def column(self, name: str, values: list[Any]) -> None:
        self.extra.setdefault(name, []).extend(values)

    def kwargs(self) -> dict[str, Any]:
        return {"log_metric": self.metric, "log_extra": self.column, "trainer_state": None}


def _humaneval_kwargs(problem: dict[str, Any], count: int) -> dict[str, Any]:
    return {"test": [problem["test"]] * count, "entry_point": [problem["entry_point"]] * count}


# -- sandbox_reward ---------------------------------------------------------------------------


def test_sandbox_reward_scores_humaneval_completions_in_sandboxes() -> None:
    problem = humaneval_problem("HumanEval/2")
    chat = [{"role": "user", "content": problem["prompt"]}]
    prompts = [problem["prompt"], chat, problem["prompt"]]
    completions = [
        problem["canonical_solution"],  # continues the prompt
        [
            {
                "role": "assistant",
                "content": "Here it is:\n```python\ndef truncate_number(number: float) -> float:\n"
                "    return number % 1.0\n```",
            }
        ],
        "    return 0.0\n",
    ]
    log = Log()
    reward = sandbox_reward()
    scores = reward(prompts, completions, **_humaneval_kwargs(problem, 3), **log.kwargs())
    assert scores == [1.0, 1.0, 0.0]
    assert reward.__name__ == "rollbox_humaneval"
    ids = log.extra["rollbox_humaneval_sandbox"]
    assert len(set(ids)) == 3 and all(i.startswith("sb-") for i in ids)
    assert log.extra["rollbox_humaneval_result"][0] == "1.00: 3/3 tests passed"
    assert log.extra["rollbox_humaneval_result"][2] == "0.00: 0/3 tests passed"
    assert log.metrics["rollbox/humaneval/sandbox_failures"] == [0.0]
    assert reward.last_results[2].details["failed"][0]["error"] == "AssertionError"
    assert_no_leftovers(set(ids))


def test_dataset_columns_feed_any_reward() -> None:
    reward = sandbox_reward(
        Weighted(
            {
                OutputMatch("python3 solution.py", Column("answer"), stdin=Column("question")): 1.0,
                CodeBlock(): 0.5,
            }
        )
    )
    completions = [
        "```python\nprint(int(input()) * 2)\n```",
        "```python\nprint(int(input()) + 2)\n```",
        "print(int(input()) * 2)",  # no code block: the text is the program
    ]
    kwargs = {"question": ["21", "3", "5"], "answer": ["42", "6", "10"]}
    log = Log()
    assert reward(["Double it."] * 3, completions, **kwargs, **log.kwargs()) == [1.5, 0.5, 1.0]
    assert log.metrics["rollbox/weighted/output_match"] == [2 / 3]
    assert log.metrics["rollbox/weighted/code_block"] == [2 / 3]


def test_a_failed_sandbox_is_no_reward_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    closed = LocalProvider()
    run_sync(closed.close())
    problem = humaneval_problem("HumanEval/2")
    reward = sandbox_reward(provider=closed)
    log = Log()
    with caplog.at_level(logging.ERROR, logger="rollbox.rewards"):
        scores = reward(
            [problem["prompt"]] * 2, ["x"] * 2, **_humaneval_kwargs(problem, 2), **log.kwargs()
        )
    assert scores == [None, None]  # TRL leaves these samples out; never a silent 0.0
    assert "the sandbox failed" in caplog.text and "this LocalProvider is closed" in caplog.text
    assert log.metrics["rollbox/humaneval/sandbox_failures"] == [2.0]
    assert log.extra["rollbox_humaneval_result"] == ["sandbox failed: no reward"] * 2


async def test_the_async_form() -> None:
    reward = sandbox_reward(asynchronous=True)
    assert is_async_callable(reward) and inspect.iscoroutinefunction(reward.__call__)
    problem = humaneval_problem("HumanEval/2")
    scores = await reward(
        [problem["prompt"]] * 2,
        [problem["canonical_solution"], "    return number\n"],
        **_humaneval_kwargs(problem, 2),
    )
    assert scores == [1.0, 0.0]


def test_sandbox_reward_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="is not a rollbox reward"):
        sandbox_reward(lambda *a: 1.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="n_concurrent must be a positive int"):
        sandbox_reward(n_concurrent=0)
    with pytest.raises(ConfigError, match="no column 'test'"):
        sandbox_reward()(["p"], ["c"], entry_point=["f"])


def test_importing_without_trl_names_the_extra() -> None:
    code = "import sys; sys.modules['trl'] = None; import rollbox.integrations.trl"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "BackendUnavailableError" in result.stderr
    assert "pip install 'rollbox[trl]'" in result.stderr


# -- SandboxToolEnv -----------------------------------------------------------------------------

ANSWER_TASK = {
    "id": "answer",
    "instruction": "Write 42 to /work/answer.txt.",
    "verifier": {
        "command": 'test "$(cat /work/answer.txt)" = 42',
    },
    "max_turns": 5,
}


def _kill(sandbox_id: str) -> None:
    async def kill() -> None:
        await (await get_provider("local").get(sandbox_id)).kill()

    run_sync(kill())


@pytest.mark.parametrize("form", ["json", "dict", "task"])
def test_env_runs_the_rows_task_and_scores_it(form: str) -> None:
    task = {"json": json.dumps(ANSWER_TASK), "dict": ANSWER_TASK, "task": Task(**ANSWER_TASK)}[form]
    env = SandboxToolEnv()
    observation = env.reset(prompt=[{"role": "user", "content": "Go."}], task=task)
    assert observation == "\n\nWrite 42 to /work/answer.txt."
    assert "exit code: 0" in env.bash("echo 42 > answer.txt && cat answer.txt")
    assert env.read_file("answer.txt") == "42\n"
    assert env.get_reward() == 1.0
    assert [event["event"] for event in env.trace] == ["reset", "bash", "read_file", "reward"]
    assert {event["sandbox_id"] for event in env.trace} == {env.sandbox_id}
    assert_no_leftovers({env.sandbox_id})  # scored, then killed


def test_reset_kills_the_previous_episodes_sandbox() -> None:
    env = SandboxToolEnv()
    env.reset(task=ANSWER_TASK)
    first = env.sandbox_id
    assert first is not None
    env.write_file("answer.txt", "41")
    env.reset(task=ANSWER_TASK)
    assert env.sandbox_id != first
    assert_no_leftovers({first})
    assert env.get_reward() == 0.0  # the new episode starts clean


def test_an_episode_that_ends_at_max_turns_keeps_its_reward() -> None:
    env = SandboxToolEnv()
    env.reset(task={**ANSWER_TASK, "max_turns": 1})
    assert "[episode over: max_turns reached]" in env.write_file("/work/answer.txt", "42")
    assert env.bash("echo too late") == "the episode is over: nothing more runs"
    assert env.get_reward() == 1.0
    assert env.result["termination"] == "max_turns"


def test_humaneval_rows_work_without_a_task_column() -> None:
    problem = humaneval_problem("HumanEval/2")
    row = {
        "prompt": [{"role": "user", "content": problem["prompt"]}],
        "test": problem["test"],
        "entry_point": problem["entry_point"],
        "task_id": problem["task_id"],
    }
    env = SandboxToolEnv()
    observation = env.reset(**row)
    assert observation is not None and "truncate_number" in observation
    assert env.read_file("/work/solution.py") == problem["prompt"]
    env.write_file("/work/solution.py", problem["prompt"] + problem["canonical_solution"])
    assert env.get_reward() == 1.0
    assert env.result["details"]["fraction"] == 1.0
    env.reset(**row)
    env.bash("echo 'def truncate_number(number): return -1.0' > /work/solution.py")
    assert env.get_reward() == 0.0


def test_a_dead_sandbox_is_no_reward(caplog: pytest.LogCaptureFixture) -> None:
    env = SandboxToolEnv()
    env.reset(task=ANSWER_TASK)
    assert env.sandbox_id is not None
    _kill(env.sandbox_id)
    with caplog.at_level(logging.ERROR, logger="rollbox.integrations.trl"):
        assert (
            env.bash("echo 42 > answer.txt")
            == "(the sandbox is gone; this episode will not be scored)"
        )
        assert env.get_reward() is None
    assert "no reward for task 'answer', the sandbox failed in bash" in caplog.text


def test_a_sandbox_that_cannot_start_is_no_reward(caplog: pytest.LogCaptureFixture) -> None:
    closed = LocalProvider()
    run_sync(closed.close())

    class Unlucky(SandboxToolEnv):
        provider = closed

    env = Unlucky()
    with caplog.at_level(logging.ERROR, logger="rollbox.integrations.trl"):
        assert env.reset(task=ANSWER_TASK) is None  # the prompt stays as it is
        assert (
            env.write_file("answer.txt", "42")
            == "(the sandbox is gone; this episode will not be scored)"
        )
        assert env.get_reward() is None
    assert "the sandbox failed in reset: SandboxStartError" in caplog.text


def test_rows_without_a_task_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"neither a 'task' column.*it has: prompt"):
        SandboxToolEnv().reset(prompt="hello")
    with pytest.raises(ConfigError, match="not JSON of a task"):
        task_from_row({"task": "{not json"})
    with pytest.raises(ConfigError, match="instruction"):
        task_from_row({"task": {"id": "x"}})
    with pytest.raises(ConfigError, match="needs the function's prompt"):
        task_from_row(
            {"prompt": [{"role": "user", "content": "Write it."}], "test": "", "entry_point": "f"}
        )


def test_close_all_kills_every_live_sandbox() -> None:
    envs = [SandboxToolEnv() for _ in range(2)]
    for env in envs:
        env.reset(task=ANSWER_TASK)
    ids = {env.sandbox_id for env in envs}
    SandboxToolEnv.close_all()
    assert_no_leftovers(ids)  # type: ignore[arg-type]


# -- a real GRPOTrainer --------------------------------------------------------------------------


def _config(tmp_path: Path, tiny_lm: TinyLM, steer: str, **options: Any) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=2,
        max_completion_length=48,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        generation_kwargs=tiny_lm.steer(steer),
        **options,
    )


def _two_problems(*, chat: bool) -> Any:
    from datasets import Dataset

    rows = []
    for task_id in ("HumanEval/2", "HumanEval/0"):
        problem = humaneval_problem(task_id)
        prompt: Any = problem["prompt"]
        if chat:
            prompt = [{"role": "user", "content": prompt}]
        rows.append(
            {
                "prompt": prompt,
                "test": problem["test"],
                "entry_point": problem["entry_point"],
                "task_id": task_id,
            }
        )
    return Dataset.from_list(rows)


def test_grpo_trainer_gets_its_rewards_from_sandboxes(tiny_lm: TinyLM, tmp_path: Path) -> None:
    from trl import GRPOTrainer

    rewards = [sandbox_reward(), sandbox_reward(asynchronous=True, name="rollbox_async")]
    seen: list[tuple[str, float, str]] = []

    class Recorded(type(rewards[0])):  # type: ignore[misc]
        """The sync reward, recording which row each score was for."""

        def __call__(self, prompts: Any, completions: Any, **kwargs: Any) -> Any:
            scores = super().__call__(prompts, completions, **kwargs)
            for task_id, score, result in zip(
                kwargs["task_id"], scores, self.last_results, strict=True
            ):
                seen.append((task_id, score, result.details["sandbox_id"]))
            return scores

    rewards[0].__class__ = Recorded
    trainer = GRPOTrainer(
        model=tiny_lm.fresh_model(),
        processing_class=tiny_lm.tokenizer,
        reward_funcs=rewards,
        args=_config(tmp_path, tiny_lm, "body"),
        train_dataset=_two_problems(chat=False),
    )
    trainer.train()
    # The steered model writes HumanEval/2's body for every prompt: only /2's tests pass it.
    assert len(seen) == 8 and len({sandbox for *_, sandbox in seen}) == 8
    assert {(task_id, score) for task_id, score, _ in seen} == {
        ("HumanEval/2", 1.0),
        ("HumanEval/0", 0.0),
    }
    assert [r.score for r in rewards[1].last_results if r is not None] != []
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2
    for entry in logged:
        assert entry["rewards/rollbox_humaneval/mean"] == 0.5
        assert entry["rewards/rollbox_async/mean"] == 0.5
        assert entry["rollbox/humaneval/sandbox_failures"] == 0.0
    assert_no_leftovers({sandbox for *_, sandbox in seen})


def test_grpo_trainer_with_sandbox_tool_environments(tiny_lm: TinyLM, tmp_path: Path) -> None:
    from trl import GRPOTrainer

    episodes: list[tuple[str, float | None, list[dict[str, Any]]]] = []

    class RecordedEnv(SandboxToolEnv):
        def get_reward(self) -> float | None:
            reward = super().get_reward()
            assert self.task is not None
            episodes.append((self.task.id, reward, list(self.trace)))
            return reward

    trainer = GRPOTrainer(
        model=tiny_lm.fresh_model(),
        processing_class=tiny_lm.tokenizer,
        args=_config(tmp_path, tiny_lm, "tool_call", max_tool_calling_iterations=1),
        train_dataset=_two_problems(chat=True),
        environment_factory=RecordedEnv,
    )
    trainer.train()
    # Each rollout: a fresh sandbox, the model's write_file call run in it, then the tests.
    assert len(episodes) == 8
    sandboxes = set()
    for task_id, reward, trace in episodes:
        assert [event["event"] for event in trace] == ["reset", "write_file", "reward"]
        (sandbox,) = {event["sandbox_id"] for event in trace}
        sandboxes.add(sandbox)
        assert reward == (1.0 if task_id == "HumanEval/2" else 0.0)
    assert len(sandboxes) == 8
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert [entry["rewards/RecordedEnv/mean"] for entry in logged] == [0.5, 0.5]
    assert all(entry["tools/call_frequency"] == 1.0 for entry in logged)
    assert_no_leftovers(sandboxes)  # every sandbox was killed once scored


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reward", "env"])
def test_the_example_runs(mode: str, tmp_path: Path) -> None:
    command = [sys.executable, str(EXAMPLE), "--mode", mode, "--steps", "1", "--problems", "2",
               "--batch-size", "2", "--max-completion-length", "16", "--output-dir", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 1: mean reward 0.000" in result.stdout
    if mode == "reward":
        assert "last batch:" in result.stdout and "sb-" in result.stdout
