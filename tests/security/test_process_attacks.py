"""Processes: orphans that try to outlive a timeout, and attacks on host and sibling processes."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from _attack_helpers import (
    assert_answers,
    assert_no_leftovers,
    host_cmdlines,
    new_sandbox,
    pid_alive,
    sh,
)

from rollbox.sandbox import _host

# Lists live processes by reading /proc directly (zombies have an empty cmdline and are skipped).
LIVE_CMDLINES = (
    "for d in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null); "
    '[ -n "$c" ] && echo "${d#/proc/} $c"; done'
)


def sleeps(listing: str) -> set[str]:
    """The distinctive `sleep 9NNN` processes in a listing."""
    return set(re.findall(r"\bsleep (9\d{3})\b", listing))


async def test_orphans_of_a_timed_out_command_are_killed(provider: object) -> None:
    sb = await new_sandbox(provider)

    # A background process of a command that ended normally is legitimate and must survive.
    keeper = await sh(sb, "setsid sleep 9431 </dev/null >/dev/null 2>&1 &")
    assert keeper.exit_code == 0, keeper

    # Every classic way to outlive the parent: setsid, nohup, a subshell, a nested setsid'd
    # background shell and a setsid'd double fork; the foreground also ignores TERM.
    attack = await sh(
        sb,
        """
        setsid sleep 9501 >/dev/null 2>&1 &
        nohup sleep 9502 >/dev/null 2>&1 &
        (sleep 9503 &)
        sh -c 'sh -c "setsid sleep 9504 </dev/null >/dev/null 2>&1 &" &'
        python3 -c 'import os; os.fork() or (os.setsid(), os.fork() or os.execvp("sleep", ["sleep", "9505"]))'
        trap '' TERM HUP INT
        sleep 600
        """,
        timeout_seconds=2,
    )
    assert attack.timed_out and attack.exit_code == -9, attack

    # Checked from a second command in the same sandbox, through /proc and through ps.
    listing = await sh(sb, LIVE_CMDLINES)
    assert sleeps(listing.stdout) == {"9431"}, listing.stdout
    ps = await sh(sb, "ps -eo stat=,args= | grep -v '^Z'")
    assert sleeps(ps.stdout) == {"9431"}, ps.stdout

    # Killing the sandbox takes the legitimate background process too, and nothing of it is
    # left on the host.
    await sb.kill()
    assert not [c for c in host_cmdlines() if re.search(r"\bsleep (9431|950\d)\b", c)]
    assert_no_leftovers({sb.id})


async def test_orphan_that_leaves_its_command_cgroup_is_killed_on_timeout(
    provider: object,
) -> None:
    """The sandbox's pids cgroup is delegated to the sandbox user (so the agent can make one
    child cgroup per command); sandboxed code runs as that same user, so it can move itself
    out of its command's cgroup. A timeout must still kill it."""
    sb = await new_sandbox(provider)
    attack = await sh(
        sb,
        """
        setsid sh -c 'echo $$ > /.rollbox/cg/cgroup.procs; exec sleep 9601' </dev/null >/dev/null 2>&1 &
        setsid sh -c 'mkdir -p /.rollbox/cg/mine; echo $$ > /.rollbox/cg/mine/cgroup.procs; exec sleep 9602' </dev/null >/dev/null 2>&1 &
        # the cgroup the agent made ahead for the next command (the newest one), where it
        # already waits: known to the agent, but no command's yet
        next=$(ls -d /.rollbox/cg/n* | sort -t n -k 2 -n | tail -n 1)
        setsid sh -c "echo \\$\\$ > $next/cgroup.procs; exec sleep 9603" </dev/null >/dev/null 2>&1 &
        sleep 600
        """,
        timeout_seconds=2,
    )
    assert attack.timed_out, attack
    listing = await sh(sb, LIVE_CMDLINES)
    survivors = sleeps(listing.stdout) & {"9601", "9602", "9603"}
    assert not survivors, f"processes of a timed-out command survived it: {listing.stdout}"

    await sb.kill()  # the sandbox kill does reap them, nested cgroup included
    assert not [c for c in host_cmdlines() if re.search(r"\bsleep 960[123]\b", c)]
    assert_no_leftovers({sb.id})


async def test_sandbox_cannot_kill_host_processes(provider: object) -> None:
    # The victim runs as the sandbox's own host uid (65534), so only the pid namespace, not
    # permissions, stands between them.
    victim = subprocess.Popen(["sleep", "3600"], user=_host.SANDBOX_UID, group=_host.SANDBOX_UID)
    victim_cgroup = Path(f"/proc/{victim.pid}/cgroup").read_text()
    sb = await new_sandbox(provider)
    try:
        attack = await sh(
            sb,
            f"""
            kill -9 {victim.pid}; echo "kill=$?"
            pkill -9 sleep; pkill -9 -u 65534 sleep
            kill -9 -1
            echo {victim.pid} > /.rollbox/cg/cgroup.procs; echo "move=$?"
            true
            """,
        )
        assert "kill=0" not in attack.stdout, attack  # no such process in the sandbox's view
        assert "move=0" not in attack.stdout, attack
        assert victim.poll() is None and pid_alive(victim.pid)
        # Not pulled into the sandbox's cgroups (whose teardown would then kill it) ...
        assert Path(f"/proc/{victim.pid}/cgroup").read_text() == victim_cgroup
        await assert_answers(sb)  # kill -9 -1 did not take the agent (PID 1) down either
        await sb.kill()
        # ... so the sandbox's teardown leaves it alone.
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    assert_no_leftovers({sb.id})


async def test_proc_shows_only_the_sandbox_processes(provider: object) -> None:
    sb = await new_sandbox(provider)
    result = await sh(sb, LIVE_CMDLINES)
    lines = result.stdout.splitlines()
    # Only the agent (PID 1), this command's shell and its helpers: no host process at all.
    assert lines[0].startswith("1 ") and "/.rollbox/agent.py" in lines[0], lines
    assert len(lines) < 10, lines
    assert not any("pytest" in line or "bwrap" in line for line in lines), lines
    # The host's pids are not there, under their host numbers.
    mine = await sh(sb, f"ls -d /proc/{os.getpid()} /proc/{os.getppid()} 2>/dev/null | wc -l")
    if os.getpid() > 100 and os.getppid() > 100:
        assert mine.stdout.strip() == "0", mine
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_sandboxes_cannot_see_or_touch_each_other(provider: object) -> None:
    victim = await new_sandbox(provider)
    attacker = await new_sandbox(provider)
    await victim.files.write("/work/secret.txt", "victim-secret-7d1f")
    await victim.files.write("/tmp/secret.txt", "victim-secret-7d1f")
    await sh(victim, "setsid sleep 9777 </dev/null >/dev/null 2>&1 &")

    attack = await sh(
        attacker,
        """
        cat /work/secret.txt /tmp/secret.txt 2>&1
        grep -rs "victim-""secret" /work /tmp /dev/shm  # split: ps must not show the needle
        pkill -9 sleep; kill -9 -1
        ps -eo args
        """,
    )
    assert "victim-secret" not in attack.stdout + attack.stderr, attack
    assert "9777" not in attack.stdout, attack
    # The victim's files and its process are intact.
    assert await victim.files.read_text("/work/secret.txt") == "victim-secret-7d1f"
    assert await victim.files.read_text("/tmp/secret.txt") == "victim-secret-7d1f"
    assert "9777" in (await sh(victim, LIVE_CMDLINES)).stdout
    await assert_answers(victim)

    await attacker.kill()
    await victim.kill()
    assert_no_leftovers({victim.id, attacker.id})
