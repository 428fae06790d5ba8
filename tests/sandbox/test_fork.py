"""A forked child (as gymnasium's AsyncVectorEnv makes) neither hangs nor kills the parent's sandboxes."""

from __future__ import annotations

import gc
import os

from rollbox import Sandbox


def test_forked_child_gets_its_own_loop_and_leaves_parent_sandboxes_alone() -> None:
    with Sandbox.create() as parent_box:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: use the sync API, drop the inherited object, exit
            status = 1
            try:
                with Sandbox.create() as child_box:
                    ok = child_box.commands.run("echo child").stdout == "child\n"
                del parent_box  # the child's copy: must not kill the parent's sandbox
                gc.collect()
                os.write(write_end, b"ok" if ok else b"bad")
                status = 0
            finally:
                os._exit(status)
        os.close(write_end)
        _, status = os.waitpid(pid, 0)
        assert os.read(read_end, 16) == b"ok" and os.waitstatus_to_exitcode(status) == 0
        assert parent_box.alive
        assert parent_box.commands.run("echo still here").stdout == "still here\n"
