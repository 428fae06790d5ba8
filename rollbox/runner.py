"""run_rollouts: an agent over a dataset, each instance in fresh sandboxes, every result kept.

Per instance, two sandboxes back to back: the agent's (``setup``, then ``solve``, which yields a
patch or final files) and a fresh one for scoring (``setup`` again, the agent's files, then
``score``), so scoring always starts from a clean task image and nothing the agent left running
can touch it. ``score_in_agent_sandbox=True`` scores the agent's own sandbox instead (after
killing every process the agent left), for tasks whose final state is the answer.

Each Rollout is appended to a JSONL file as soon as it is known (one ``write`` and an
``fsync``), so Ctrl-C or a crash loses no finished result, and a second run with the same file
skips what is done.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollbox.errors import BackendUnavailableError, ConfigError, SandboxDeadError, SandboxError
from rollbox.sandbox.base import AsyncSandbox, Provider
from rollbox.sandbox.models import SandboxSpec


class AgentResult(BaseModel):
    """What an agent's ``solve`` returns.

    ``patch`` is the agent's answer as text (a diff, a program, a final message); ``files`` are
    final files (sandbox path -> content) written into the scoring sandbox before ``score``.
    ``exit`` says how the agent ended (``submitted``, ``max_turns``, ``gave_up``, ...).
    """

    model_config = ConfigDict(extra="forbid")

    patch: str = ""
    files: dict[str, str] = Field(default_factory=dict)
    exit: str = "submitted"
    metadata: dict[str, Any] = Field(default_factory=dict)


class Rollout(BaseModel):
    """One instance's outcome; one line of results.jsonl.

    ``score`` and ``resolved`` are None when there is no score: the instance was ``skipped``
    (its setup declined it) or an ``error`` (the sandbox, the agent code or the dataset failed,
    not the policy). An agent that ran out of time scores 0.0 with ``agent_exit="timeout"``.
    """

    model_config = ConfigDict(extra="forbid")

    instance_id: str
    patch: str | None = None
    score: float | None = None
    resolved: bool | None = None
    agent_exit: str | None = None
    error: str | None = None
    skipped: bool = False
    duration_s: float = 0.0
    details: dict[str, Any] = Field(default_factory=dict)
    template_id: str | None = None
    retries: list[str] = Field(
        default_factory=list,
        description="why the instance ran again from the start: a node that died under its "
        "sandbox (infrastructure, not the policy)",
    )

    @property
    def done(self) -> bool:
        """Finished for good: scored or skipped (an error is worth another try)."""
        return self.error is None


@runtime_checkable
class Dataset(Protocol):
    """Where instances come from, how their sandbox starts, how an answer is scored.

    An instance is any object; its id is ``instance_id(instance)`` if the dataset defines that
    method, else the instance's ``id``/``instance_id`` attribute or ``"instance_id"``/``"id"``/
    ``"task_id"`` key.
    """

    def instances(self) -> Iterable[Any]:
        """The instances, in order."""
        ...

    def template(self, instance: Any) -> str | SandboxSpec:
        """The sandbox of an instance: a template name, or a full SandboxSpec (limits, ...)."""
        ...

    async def setup(self, sandbox: AsyncSandbox, instance: Any) -> bool:
        """Prepare a fresh sandbox; False skips the instance."""
        ...

    async def score(self, sandbox: AsyncSandbox, instance: Any, patch: str) -> Mapping[str, Any]:
        """Score an answer: ``{"score": float, "resolved": bool, ...}`` (the rest is details)."""
        ...


@runtime_checkable
class Agent(Protocol):
    """Solves one instance in its sandbox."""

    async def solve(
        self, sandbox: AsyncSandbox, instance: Any, *, model: str | None
    ) -> AgentResult:
        """Work in ``sandbox``; return the answer."""
        ...


RolloutCallback = Callable[[Rollout], Any]

# How many times an instance runs again after the node under its sandbox died (provider="ray").
NODE_RETRIES = 3


def instance_id_of(dataset: Any, instance: Any, position: int) -> str:
    """The id of an instance (see ``Dataset``); ConfigError if it has none."""
    if hasattr(dataset, "instance_id"):
        value = dataset.instance_id(instance)
    elif isinstance(instance, Mapping):
        value = next((instance[k] for k in ("instance_id", "id", "task_id") if k in instance), None)
    else:
        value = getattr(instance, "instance_id", None) or getattr(instance, "id", None)
    if not isinstance(value, str | int) or isinstance(value, bool) or value == "":
        raise ConfigError(
            f"instance #{position} ({type(instance).__name__}) has no id: give it an `id` "
            "attribute or key, or define Dataset.instance_id(instance)"
        )
    return str(value)


def read_rollouts(path: str | os.PathLike[str]) -> list[Rollout]:
    """The Rollouts of a results file, last line per instance winning.

    A half-written last line (a run killed mid-write) is ignored; any other bad line raises
    ConfigError naming it.
    """
    source = Path(path)
    if not source.exists():
        return []
    lines = source.read_text(encoding="utf-8").splitlines()
    found: dict[str, Rollout] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rollout = Rollout.model_validate_json(line)
        except ValidationError as exc:
            if number == len(lines) and not source.read_bytes().endswith(b"\n"):
                break
            raise ConfigError(
                f"{source} line {number}: not a Rollout ({exc.errors()[0]['msg']}); move the "
                "file away to start afresh"
            ) from None
        found.pop(rollout.instance_id, None)
        found[rollout.instance_id] = rollout
    return list(found.values())


class _ResultsFile:
    """Appends one Rollout a line: one write and an fsync each, so a crash loses none."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):  # a line a killed run left half-written
                os.truncate(path, data.rfind(b"\n") + 1)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, rollout: Rollout) -> None:
        data = (rollout.model_dump_json() + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def _spec_of(dataset: Any, instance: Any) -> SandboxSpec:
    value = dataset.template(instance)
    if isinstance(value, SandboxSpec):
        return value
    if isinstance(value, str):
        return SandboxSpec(template=value)
    raise ConfigError(
        f"Dataset.template() returned {type(value).__name__}; return a template name or a "
        "SandboxSpec"
    )


def _as_agent_result(value: Any) -> AgentResult:
    if isinstance(value, AgentResult):
        return value
    if isinstance(value, str):
        return AgentResult(patch=value)
    if isinstance(value, Mapping):
        try:
            return AgentResult(**value)
        except ValidationError as exc:
            raise ConfigError(f"Agent.solve returned an invalid result: {exc}") from exc
    raise ConfigError(
        f"Agent.solve returned {type(value).__name__}; return an AgentResult (or a patch str)"
    )


def _as_score(value: Any) -> tuple[float, bool, dict[str, Any]]:
    """``(score, resolved, details)`` from what Dataset.score returned."""
    if hasattr(value, "model_dump") and hasattr(value, "score"):
        value = value.model_dump()  # e.g. a rewards.RewardResult
    elif not isinstance(value, Mapping) and isinstance(value, int | float):
        value = {"score": value}
    if not isinstance(value, Mapping) or "score" not in value:
        raise ConfigError(
            f"Dataset.score returned {type(value).__name__}; return a dict with a 'score'"
        )
    score = value["score"]
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise ConfigError(f"Dataset.score returned score={score!r}; it must be a number")
    resolved = value.get("resolved", score >= 1.0)
    details = {k: v for k, v in value.items() if k not in ("score", "resolved")}
    return float(score), bool(resolved), json.loads(json.dumps(details, default=str))


def _node_death(exc: BaseException) -> SandboxDeadError | None:
    """The SandboxDeadError(reason="node_died") behind ``exc``, also when code wrapped it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, SandboxDeadError) and current.reason == "node_died":
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


async def _call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    value = function(*args, **kwargs)
    return await value if inspect.isawaitable(value) else value


class _Runner:
    def __init__(
        self,
        dataset: Any,
        agent: Any,
        *,
        provider: str | Provider,
        model: str | None,
        score_in_agent_sandbox: bool,
        agent_timeout_seconds: float | None,
        score_timeout_seconds: float | None,
    ) -> None:
        self.dataset = dataset
        self.agent = agent
        self.provider = provider
        self.model = model
        self.score_in_agent_sandbox = score_in_agent_sandbox
        self.agent_timeout = agent_timeout_seconds
        self.score_timeout = score_timeout_seconds

    async def rollout(self, instance: Any, instance_id: str) -> Rollout:
        """One instance, start to end; every failure becomes the Rollout's ``error``.

        An instance whose sandbox died with its node runs again from the start (on another
        node: the provider places it), up to ``NODE_RETRIES`` times; ``retries`` says why.
        """
        started = time.monotonic()
        retries: list[str] = []
        while True:
            record: dict[str, Any] = {"instance_id": instance_id}
            try:
                record.update(await self._rollout(instance, record))
            except (BackendUnavailableError, asyncio.CancelledError):
                raise  # the machine cannot run anything: stop the batch
            except TimeoutError:
                record["error"] = f"scoring took longer than {self.score_timeout} s"
            except Exception as exc:
                lost = _node_death(exc)
                if lost is not None and len(retries) < NODE_RETRIES:
                    retries.append(str(lost))
                    continue
                if isinstance(exc, SandboxError):
                    record["error"] = f"sandbox failure: {type(exc).__name__}: {exc}"
                else:
                    stage = record.pop("_stage", "run")
                    record["error"] = f"{stage} raised {type(exc).__name__}: {exc}"
            break
        record.pop("_stage", None)
        record["retries"] = retries
        record["duration_s"] = round(time.monotonic() - started, 4)
        return Rollout(**record)

    async def _rollout(self, instance: Any, record: dict[str, Any]) -> dict[str, Any]:
        spec = _spec_of(self.dataset, instance)
        async with await self._sandbox(spec, record) as sandbox:
            record["template_id"] = sandbox.template_id
            record["_stage"] = "Dataset.setup"
            if not await _call(self.dataset.setup, sandbox, instance):
                return {"skipped": True}
            record["_stage"] = "Agent.solve"
            try:
                answer = await asyncio.wait_for(
                    _call(self.agent.solve, sandbox, instance, model=self.model),
                    self.agent_timeout,
                )
            except TimeoutError:
                # the policy's failure, not the infrastructure's: it scores 0
                return {"agent_exit": "timeout", "score": 0.0, "resolved": False}
            result = _as_agent_result(answer)
            record.update(patch=result.patch, agent_exit=result.exit)
            if self.score_in_agent_sandbox:
                from rollbox.envs.verify import stop_agent_processes

                problem = await stop_agent_processes(sandbox)
                if problem is not None:  # the agent's processes hold the sandbox: its doing
                    return {"score": 0.0, "resolved": False, "details": {"error": problem}}
                return await self._score(sandbox, instance, result, record, write_files=False)
        async with await self._sandbox(spec, record) as fresh:
            record["_stage"] = "Dataset.setup (scoring sandbox)"
            if not await _call(self.dataset.setup, fresh, instance):
                raise ConfigError("setup declined the instance in the scoring sandbox")
            return await self._score(fresh, instance, result, record, write_files=True)

    async def _sandbox(self, spec: SandboxSpec, record: dict[str, Any]) -> AsyncSandbox:
        record["_stage"] = "sandbox start"
        return await AsyncSandbox.create(
            spec.name or record["instance_id"][:128],
            from_template=spec.template,
            network=spec.network,
            limits=spec.limits,
            env_vars=spec.env_vars,
            ttl_seconds=spec.ttl_seconds,
            provider=self.provider,
        )

    async def _score(
        self,
        sandbox: AsyncSandbox,
        instance: Any,
        result: AgentResult,
        record: dict[str, Any],
        *,
        write_files: bool,
    ) -> dict[str, Any]:
        if write_files:
            record["_stage"] = "writing the agent's files"
            for path, content in result.files.items():
                await sandbox.files.write(path, content)
        record["_stage"] = "Dataset.score"
        value = await asyncio.wait_for(
            _call(self.dataset.score, sandbox, instance, result.patch), self.score_timeout
        )
        score, resolved, details = _as_score(value)
        return {"score": score, "resolved": resolved, "details": details}


async def run_rollouts(
    dataset: Dataset,
    agent: Agent,
    *,
    provider: str | Provider = "local",
    n_concurrent: int = 8,
    out: str | os.PathLike[str] | None = None,
    model: str | None = None,
    score_in_agent_sandbox: bool = False,
    agent_timeout_seconds: float | None = 1800.0,
    score_timeout_seconds: float | None = 600.0,
    retry_errors: bool = True,
    on_rollout: RolloutCallback | None = None,
) -> list[Rollout]:
    """Run ``agent`` on every instance of ``dataset``; Rollouts in input order.

    Args:
        dataset: instances, their sandbox template, setup and scoring (see ``Dataset``).
        agent: ``solve(sandbox, instance, model=...)`` (see ``Agent``).
        provider: a provider name or instance.
        n_concurrent: instances at once.
        out: a JSONL file; each Rollout is appended as it finishes. Instances already done
            there are not run again (their Rollouts are returned as they were).
        model: passed to ``solve``.
        score_in_agent_sandbox: score the agent's sandbox instead of a fresh one.
        agent_timeout_seconds: an agent that takes longer scores 0 (``agent_exit="timeout"``).
        score_timeout_seconds: scoring that takes longer is an error.
        retry_errors: run again the instances whose earlier Rollout was an error.
        on_rollout: called with each new Rollout.

    Raises:
        ConfigError: bad arguments, an instance without id, two instances with one id.
        BackendUnavailableError: the provider cannot run sandboxes here.
    """
    if n_concurrent < 1:
        raise ConfigError(f"n_concurrent must be at least 1, got {n_concurrent}")
    for name, value, kind in (("dataset", dataset, Dataset), ("agent", agent, Agent)):
        if not isinstance(value, kind):
            missing = [
                m
                for m in ("instances", "template", "setup", "score", "solve")
                if hasattr(kind, m) and not hasattr(value, m)
            ]
            raise ConfigError(f"{name} {value!r} lacks {', '.join(missing)} (see rollbox.runner)")
    instances = list(dataset.instances())
    ids: list[str] = []
    seen: dict[str, int] = {}
    for position, instance in enumerate(instances):
        instance_id = instance_id_of(dataset, instance, position)
        if instance_id in seen:
            raise ConfigError(
                f"instances #{seen[instance_id]} and #{position} share the id {instance_id!r}"
            )
        seen[instance_id] = position
        ids.append(instance_id)

    results: list[Rollout | None] = [None] * len(instances)
    if out is not None:
        earlier = {r.instance_id: r for r in read_rollouts(out)}
        for position, instance_id in enumerate(ids):
            previous = earlier.get(instance_id)
            if previous is not None and (previous.done or not retry_errors):
                results[position] = previous
    todo = iter([p for p, r in enumerate(results) if r is None])
    sink = _ResultsFile(Path(out)) if out is not None else None
    runner = _Runner(
        dataset,
        agent,
        provider=provider,
        model=model,
        score_in_agent_sandbox=score_in_agent_sandbox,
        agent_timeout_seconds=agent_timeout_seconds,
        score_timeout_seconds=score_timeout_seconds,
    )

    async def work() -> None:
        for position in todo:  # one shared iterator: each position is taken once
            rollout = await runner.rollout(instances[position], ids[position])
            results[position] = rollout
            if sink is not None:
                sink.append(rollout)
            if on_rollout is not None:
                on_rollout(rollout)

    workers = [asyncio.ensure_future(work()) for _ in range(n_concurrent)]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)  # each kills its sandboxes
        raise
    finally:
        if sink is not None:
            sink.close()
    return [r for r in results if r is not None]


def summarize(rollouts: Sequence[Rollout]) -> dict[str, Any]:
    """Counts and rates of a set of Rollouts (for the summary table and the report)."""
    scored = [r for r in rollouts if r.error is None and not r.skipped and r.score is not None]
    resolved = sum(1 for r in scored if r.resolved)
    return {
        "instances": len(rollouts),
        "scored": len(scored),
        "resolved": resolved,
        "unresolved": len(scored) - resolved,
        "skipped": sum(1 for r in rollouts if r.skipped),
        "errors": sum(1 for r in rollouts if r.error is not None),
        "agent_timeouts": sum(1 for r in rollouts if r.agent_exit == "timeout"),
        "resolve_rate": resolved / len(scored) if scored else None,
        "mean_score": sum(r.score or 0.0 for r in scored) / len(scored) if scored else None,
    }


__all__ = [
    "Agent",
    "AgentResult",
    "Dataset",
    "Rollout",
    "read_rollouts",
    "run_rollouts",
    "summarize",
]
