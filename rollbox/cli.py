"""The ``rollbox`` command: doctor, demo, cleanup.

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
from typing import NoReturn

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
    return 0


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
