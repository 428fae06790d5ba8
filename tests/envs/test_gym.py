"""SandboxEnv as a gymnasium env: env checker, registered ids, vector envs, and cleanup."""

from __future__ import annotations

import gc
import pickle
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from gymnasium.spaces import Text
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

import rollbox.envs
from rollbox.envs import SandboxEnv
from rollbox.errors import ConfigError
from tests.conftest import assert_no_leftovers
from tests.envs.conftest import answer_task


def _check_env_without_warnings(env: gymnasium.Env) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    assert not [str(w.message) for w in caught]


def test_check_env_passes_on_a_direct_instance() -> None:
    env = SandboxEnv(answer_task())
    _check_env_without_warnings(env)
    env.close()
    assert env.sandbox_id is None


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [("rollbox/Shell-v0", {"task": answer_task()}), ("rollbox/HumanEval-v0", {})],
)
def test_check_env_passes_on_registered_ids(env_id: str, kwargs: dict[str, object]) -> None:
    env = gymnasium.make(env_id, **kwargs)
    assert env.spec is not None and env.spec.nondeterministic
    _check_env_without_warnings(env.unwrapped)
    env.close()


def test_spaces_are_wide_printable_text() -> None:
    env = SandboxEnv(answer_task())
    for space in (env.observation_space, env.action_space):
        assert isinstance(space, Text)
        assert space.min_length == 0
        assert "" in space and "ls -la | grep 'x' > \"y\"\n\té中" in space
        assert "\x00" not in space
    copy = pickle.loads(pickle.dumps(env.observation_space))
    assert copy == env.observation_space and copy.sample() in copy


def test_make_shell_with_a_task_runs_an_episode() -> None:
    env = gymnasium.make("rollbox/Shell-v0", task=answer_task())
    obs, info = env.reset(seed=0)
    assert obs == answer_task().instruction
    sandbox_id = info["sandbox_id"]
    obs, reward, terminated, truncated, info = env.step("echo 42 > answer.txt && cat answer.txt")
    assert "42" in obs and reward == 0.0 and not terminated and not truncated
    obs, reward, terminated, truncated, info = env.step({"tool": "submit"})
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["reward_components"] == {"tests": 1.0}
    env.close()
    assert_no_leftovers({sandbox_id})


def test_make_shell_with_the_task_in_options() -> None:
    with pytest.raises(ConfigError, match="no task to run"):
        gymnasium.make("rollbox/Shell-v0").reset()
    # (a fresh env: gymnasium 1.4's passive checker breaks after a first reset that raised)
    env = gymnasium.make("rollbox/Shell-v0")
    obs, _ = env.reset(options={"task": answer_task(expected="7")})
    assert "Write 7" in obs
    env.step("echo 7 > answer.txt")
    assert env.step('{"tool": "submit"}')[1] == 1.0
    env.close()


def test_sync_vector_env() -> None:
    envs = gymnasium.make_vec(
        "rollbox/Shell-v0", num_envs=2, vectorization_mode="sync", task=answer_task()
    )
    assert isinstance(envs, SyncVectorEnv)
    obs, info = envs.reset(seed=1)
    assert obs == (answer_task().instruction,) * 2
    ids = set(info["sandbox_id"])
    assert len(ids) == 2
    envs.step(["echo 42 > answer.txt", "echo 41 > answer.txt"])
    _, rewards, terminated, truncated, info = envs.step(['{"tool": "submit"}'] * 2)
    assert rewards.tolist() == [1.0, 0.0] and terminated.all() and not truncated.any()
    assert info["reward_components"]["tests"].tolist() == [1.0, 0.0]
    # the next step autoresets both into fresh sandboxes
    obs, _, _, _, info = envs.step(["true", "true"])
    assert not ids & set(info["sandbox_id"])
    ids |= set(info["sandbox_id"])
    envs.close()
    assert_no_leftovers(ids)


@pytest.mark.parametrize("via_make_vec", [True, False])
def test_async_vector_env(via_make_vec: bool) -> None:
    # Text observations need shared_memory=False (gymnasium 1.4 garbles them otherwise)
    if via_make_vec:
        envs = gymnasium.make_vec(
            "rollbox/Shell-v0",
            num_envs=2,
            vectorization_mode="async",
            vector_kwargs={"shared_memory": False},
            task=answer_task(),
        )
    else:
        envs = AsyncVectorEnv(
            [lambda: SandboxEnv(answer_task()) for _ in range(2)], shared_memory=False
        )
    assert isinstance(envs, AsyncVectorEnv)
    obs, info = envs.reset(seed=3)
    assert obs == (answer_task().instruction,) * 2
    ids = set(info["sandbox_id"])
    obs, *_ = envs.step(["echo 42 > answer.txt; echo one", "echo 41 > answer.txt; echo two"])
    assert "one" in obs[0] and "two" in obs[1]
    _, rewards, terminated, _, _ = envs.step([{"tool": "submit"}, {"tool": "submit"}])
    assert rewards.tolist() == [1.0, 0.0] and terminated.all()
    envs.close()
    assert_no_leftovers(ids)


def test_vector_env_action_space_samples_run() -> None:
    envs = gymnasium.make_vec(
        "rollbox/Shell-v0", num_envs=2, vectorization_mode="sync", task=answer_task()
    )
    _, info = envs.reset(seed=0)
    envs.action_space.seed(0)
    obs, rewards, *_ = envs.step(envs.action_space.sample())
    assert all(o in envs.single_observation_space for o in obs)
    assert np.all(rewards == 0.0)
    envs.close()
    assert_no_leftovers(set(info["sandbox_id"]))


def test_garbage_collection_kills_the_sandbox() -> None:
    env = SandboxEnv(answer_task())
    env.reset()
    env.step("sleep 1000 &")
    sandbox_id = env.sandbox_id
    assert sandbox_id is not None
    del env
    gc.collect()
    assert_no_leftovers({sandbox_id})


def test_an_exception_in_step_kills_the_sandbox() -> None:
    env = SandboxEnv(answer_task(verifier=lambda sandbox, task: 1 / 0))
    env.reset()
    sandbox_id = env.sandbox_id
    with pytest.raises(ZeroDivisionError):
        env.step({"tool": "submit"})
    assert env.sandbox_id is None
    assert_no_leftovers({sandbox_id})
    env.close()


def test_close_leaves_nothing_and_may_repeat() -> None:
    env = SandboxEnv(answer_task())
    env.close()  # before any reset
    env.reset()
    first = env.sandbox_id
    env.reset()
    second = env.sandbox_id
    env.step("sleep 1000 & setsid sleep 1001 &")
    env.close()
    env.close()
    assert_no_leftovers({first, second})


_INTERRUPTED = textwrap.dedent(
    """
    import sys
    import rollbox.envs
    from tests.envs.conftest import answer_task
    env = rollbox.envs.SandboxEnv(answer_task())
    env.reset()
    env.step("sleep 1000 >/dev/null 2>&1 &")
    print(env.sandbox_id, flush=True)
    env.step("sleep 1000")   # Ctrl-C lands here
    """
)


def test_ctrl_c_during_a_step_leaves_nothing() -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],  # the repository, for `tests.envs.conftest`
    )
    assert owner.stdout is not None
    sandbox_id = owner.stdout.readline().strip()
    assert sandbox_id.startswith("sb-"), sandbox_id
    owner.send_signal(signal.SIGINT)
    assert owner.wait(timeout=30) != 0  # KeyboardInterrupt
    assert_no_leftovers({sandbox_id})


def test_render_modes_are_refused() -> None:
    with pytest.raises(ConfigError, match="render_mode"):
        SandboxEnv(answer_task(), render_mode="human")


def test_ids_are_registered_on_import() -> None:
    assert {"rollbox/Shell-v0", "rollbox/HumanEval-v0"} <= set(gymnasium.registry)
    assert rollbox.envs.SHELL_ENV_ID == "rollbox/Shell-v0"
