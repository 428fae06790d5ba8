"""run_rollouts with real sandboxes: order, isolation of scoring, failures, resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollbox.errors import ConfigError
from rollbox.runner import Rollout, read_rollouts, run_rollouts, summarize
from rollbox.sandbox.local import LocalProvider
from tests.conftest import assert_no_leftovers
from tests.runner.fixtures import AnswerDataset, ScriptedAgent


def _instances(*modes: str) -> list[dict[str, Any]]:
    return [{"id": f"i{n}", "expected": str(100 + n), "mode": m} for n, m in enumerate(modes)]


async def test_results_in_input_order_with_failures_recorded(
    provider: LocalProvider, tmp_path: Path
) -> None:
    modes = ("right", "wrong", "raises", "skip", "setup-raises", "score-raises", "right")
    dataset, agent = AnswerDataset(_instances(*modes)), ScriptedAgent()
    out = tmp_path / "results.jsonl"
    rollouts = await run_rollouts(dataset, agent, provider=provider, n_concurrent=3, out=out)

    assert [r.instance_id for r in rollouts] == [f"i{n}" for n in range(len(modes))]
    assert all(isinstance(r, Rollout) for r in rollouts)
    right, wrong, raises, skip, setup_raises, score_raises, last = rollouts
    for good in (right, last):
        assert (good.score, good.resolved, good.error, good.agent_exit) == (
            1.0,
            True,
            None,
            "submitted",
        )
        assert good.details["answer"] == str(100 + int(good.instance_id[1:]))
        assert good.template_id and good.template_id.startswith("python:")
    assert (wrong.score, wrong.resolved, wrong.error) == (0.0, False, None)
    assert wrong.patch == "-1"
    # infrastructure, agent-code and dataset failures are errors, never a score of 0
    assert (
        raises.score is None
        and "Agent.solve raised RuntimeError: the model API is down" in raises.error
    )
    assert skip.skipped and skip.score is None and skip.error is None
    assert "Dataset.setup raised RuntimeError" in setup_raises.error
    assert "Dataset.score raised ValueError: the scorer is broken" in score_raises.error
    assert all(r.duration_s > 0 for r in rollouts)

    # every rollout reached the file, one JSON object a line
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["instance_id"] for line in lines) == sorted(r.instance_id for r in rollouts)
    assert summarize(rollouts) == {
        "instances": 7, "scored": 3, "resolved": 2, "unresolved": 1, "skipped": 1, "errors": 3,
        "agent_timeouts": 0, "resolve_rate": 2 / 3, "mean_score": 2 / 3,
    }  # fmt: skip
    assert_no_leftovers(set(dataset.setups))


async def test_scoring_starts_from_a_clean_sandbox(provider: LocalProvider) -> None:
    dataset, agent = AnswerDataset(_instances("tamper", "right")), ScriptedAgent()
    rollouts = await run_rollouts(dataset, agent, provider=provider, n_concurrent=2)
    for rollout in rollouts:
        assert rollout.resolved, rollout
        # a fresh sandbox: what the agent left (files, processes) is not there
        assert rollout.details["agent_files_seen"] is False
    # two sandboxes per instance: the agent's and the scorer's
    assert len(dataset.setups) == 4 and len(set(dataset.setups)) == 4
    assert_no_leftovers(set(dataset.setups))


async def test_score_in_agent_sandbox_stops_what_the_agent_left_running(
    provider: LocalProvider,
) -> None:
    dataset, agent = AnswerDataset(_instances("tamper")), ScriptedAgent()
    (rollout,) = await run_rollouts(dataset, agent, provider=provider, score_in_agent_sandbox=True)
    assert rollout.details["agent_files_seen"] is True  # the agent's own sandbox
    # the tamperer would have written "wrong" 0.5 s after the agent returned; it was killed
    assert (rollout.score, rollout.details["answer"]) == (1.0, "100")
    assert len(dataset.setups) == 1
    assert_no_leftovers(set(dataset.setups))


async def test_agent_timeout_scores_zero_and_kills_its_sandbox(provider: LocalProvider) -> None:
    dataset, agent = AnswerDataset(_instances("hangs", "right")), ScriptedAgent()
    hung, fine = await run_rollouts(
        dataset, agent, provider=provider, n_concurrent=2, agent_timeout_seconds=1.0
    )
    assert (hung.agent_exit, hung.score, hung.resolved, hung.error) == ("timeout", 0.0, False, None)
    assert fine.resolved
    assert_no_leftovers(set(dataset.setups))


async def test_n_concurrent_bounds_the_agents_at_work(provider: LocalProvider) -> None:
    instances = [{"id": f"s{n}", "expected": "1", "mode": "slow", "seconds": 0.3} for n in range(8)]
    dataset, agent = AnswerDataset(instances), ScriptedAgent()
    rollouts = await run_rollouts(dataset, agent, provider=provider, n_concurrent=3)
    assert agent.most_at_once == 3
    assert all(r.resolved for r in rollouts)


async def test_resume_skips_what_is_done_and_retries_errors(
    provider: LocalProvider, tmp_path: Path
) -> None:
    out = tmp_path / "results.jsonl"
    first = AnswerDataset(_instances("right", "raises", "wrong"))
    await run_rollouts(first, ScriptedAgent(), provider=provider, out=out)

    # the second run: the agent is fixed; only the errored instance runs again
    second, agent = AnswerDataset(_instances("right", "right", "right")), ScriptedAgent()
    rollouts = await run_rollouts(second, agent, provider=provider, out=out)
    assert agent.calls == ["i1"]
    assert [(r.instance_id, r.resolved) for r in rollouts] == [
        ("i0", True), ("i1", True), ("i2", False)  # i2 was scored before: kept as it was
    ]  # fmt: skip
    assert len(out.read_text().splitlines()) == 4  # appended, never rewritten
    on_file = {r.instance_id: r for r in read_rollouts(out)}  # the last line of i1 wins
    assert sorted(on_file) == ["i0", "i1", "i2"] and on_file["i1"].resolved


async def test_a_half_written_last_line_is_dropped_on_resume(
    provider: LocalProvider, tmp_path: Path
) -> None:
    out = tmp_path / "results.jsonl"
    done = Rollout(instance_id="i0", score=1.0, resolved=True).model_dump_json()
    out.write_text(done + "\n" + '{"instance_id": "i1", "sco')  # killed mid-write
    dataset, agent = AnswerDataset(_instances("right", "right")), ScriptedAgent()
    rollouts = await run_rollouts(dataset, agent, provider=provider, out=out)
    assert agent.calls == ["i1"] and all(r.resolved for r in rollouts)
    assert [json.loads(line)["instance_id"] for line in out.read_text().splitlines()] == [
        "i0",
        "i1",
    ]


async def test_a_corrupt_line_in_the_middle_is_an_error_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    out.write_text('{"instance_id": "i0"}\nnot json\n{"instance_id": "i1"}\n')
    with pytest.raises(ConfigError, match=r"results.jsonl line 2: not a Rollout"):
        await run_rollouts(AnswerDataset(_instances("right")), ScriptedAgent(), out=out)


@pytest.mark.parametrize(
    ("instances", "message"),
    [
        ([{"id": "a", "expected": "1"}, {"id": "a", "expected": "2"}], "share the id 'a'"),
        ([{"expected": "1"}], r"instance #0 \(dict\) has no id"),
    ],
)
async def test_bad_datasets_are_refused_before_anything_runs(
    instances: list[dict[str, Any]], message: str
) -> None:
    dataset, agent = AnswerDataset(instances), ScriptedAgent()
    with pytest.raises(ConfigError, match=message):
        await run_rollouts(dataset, agent)
    assert not dataset.setups


async def test_objects_that_are_not_datasets_or_agents_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"dataset .* lacks instances, template, setup, score"):
        await run_rollouts(object(), ScriptedAgent())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"agent .* lacks solve"):
        await run_rollouts(AnswerDataset([]), object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="n_concurrent must be at least 1"):
        await run_rollouts(AnswerDataset([]), ScriptedAgent(), n_concurrent=0)
