"""rollbox as a Harbor environment: Harbor's own trials, each in a rollbox sandbox.

Needs ``pip install 'rollbox[harbor]'`` (Harbor needs Python >= 3.12)::

    harbor run -p path/to/task -a oracle -e rollbox.integrations.harbor:RollboxEnvironment
    harbor run -p path/to/tasks -a nop -e rollbox.integrations.harbor:RollboxEnvironment \\
        --ek provider=docker

The task's ``environment/Dockerfile`` (or ``docker_image``) becomes a rollbox template, as
``rollbox.envs.harbor`` describes: on the local backend a trial starts in tens of milliseconds
once the template is built, with no Docker and no cloud account. Environment kwargs (``--ek``):
``provider`` (``local``, the default, or ``docker``) and ``ttl_seconds`` (how long a sandbox may
live whatever happens to Harbor; default from the task's timeouts).

What differs from Harbor's Docker environment:

- every command runs as the sandbox's unprivileged user; ``user=`` (root included) is accepted
  and changes nothing. The template hands the task's directories and Harbor's (``/logs``,
  ``/tests``, ``/solution``) to that user;
- when the verifier uploads ``/tests``, every process the agent left is killed first,
  ``/tests`` and the reward files are emptied, and later commands get a fresh ``HOME``, so
  nothing the agent left running or planted meets the tests;
- network: ``no-network``, ``public`` and IPv4 allow-lists, fixed for the sandbox's life;
- no GPUs, no Docker Compose, no mounts: logs are downloaded from the sandbox.
"""

from __future__ import annotations

import posixpath
import shlex
import tomllib
from pathlib import Path
from typing import Any

from rollbox.errors import BackendUnavailableError, ConfigError

try:
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.environments.capabilities import (
        EnvironmentCapabilities,
        EnvironmentResourceCapabilities,
    )
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the Harbor integration needs Harbor ({exc}): pip install 'rollbox[harbor]' "
        "(Harbor needs Python >= 3.12)"
    ) from exc

from rollbox.envs.harbor import (
    DEFAULT_LIMITS,
    TESTS_DIR,
    VERIFIER_LOGS_DIR,
    HarborImage,
    _fresh_directory,
    harbor_network,
    image_template,
    task_scripts,
    translate_dockerfile,
    verifier_home,
)
from rollbox.sandbox.base import AsyncSandbox
from rollbox.sandbox.models import Limits
from rollbox.sandbox.registry import get_provider

__all__ = ["RollboxEnvironment"]


class RollboxEnvironment(BaseEnvironment):
    """A Harbor environment whose container is a rollbox sandbox.

    Args (besides Harbor's): ``provider``, a rollbox provider name (``local`` or ``docker``);
    ``ttl_seconds``, a bound on the sandbox's life.
    """

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: TrialPaths,
        task_env_config: EnvironmentConfig,
        *args: Any,
        provider: str = "local",
        ttl_seconds: float | str | None = None,
        **kwargs: Any,
    ) -> None:
        if provider not in ("local", "docker"):
            raise ConfigError(f"provider={provider!r}: RollboxEnvironment runs on local or docker")
        self._provider_name = provider
        self._ttl_seconds = float(ttl_seconds) if ttl_seconds is not None else None
        self._sandbox: AsyncSandbox | None = None
        self._image: HarborImage | None = None
        self._shell: str | None = None
        self._verifier_home: str | None = None  # set once the tests are uploaded
        super().__init__(
            environment_dir,
            environment_name,
            session_id,
            trial_paths,
            task_env_config,
            *args,
            **kwargs,
        )

    @staticmethod
    def type() -> str:
        return "rollbox"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv4_cidrs=True,
        )

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(
            cpu_limit=True, memory_limit=True, fractional_cpus=True
        )

    # -- definition -------------------------------------------------------------------------

    def _task_dir(self) -> Path | None:
        parent = Path(self.environment_dir).resolve().parent
        return parent if (parent / "task.toml").is_file() else None

    def _validate_definition(self) -> None:
        if self.os.value != "linux":
            raise ConfigError("RollboxEnvironment runs Linux tasks only")
        directory = Path(self.environment_dir)
        for compose in ("docker-compose.yaml", "docker-compose.yml"):
            if (directory / compose).exists():
                raise ConfigError(f"{directory / compose}: Docker Compose is not supported")
        backend = "docker" if self._provider_name == "docker" else "local"
        name = (
            "harbor-"
            + "".join(c if c.isalnum() or c in "_.-" else "-" for c in self.environment_name).strip(
                "-."
            )[:100]
        )
        dockerfile = directory / "Dockerfile"
        if dockerfile.is_file():
            self._image = translate_dockerfile(
                dockerfile,
                name=name or "harbor-task",
                backend=backend,
                workdir=self.task_env_config.workdir,
                also_scan=task_scripts(self._task_dir()),
            )
        elif self.task_env_config.docker_image:
            self._image = image_template(
                self.task_env_config.docker_image,
                name=name or "harbor-task",
                backend=backend,
                workdir=self.task_env_config.workdir,
                also_scan=task_scripts(self._task_dir()),
            )
        else:
            raise FileNotFoundError(f"{directory}: no Dockerfile and no [environment].docker_image")

    # -- lifecycle --------------------------------------------------------------------------

    def _limits(self) -> Limits:
        values = {
            "cpus": self._effective_cpus,
            "memory_mb": self._effective_memory_mb,
            "disk_mb": self._effective_storage_mb,
        }
        return DEFAULT_LIMITS.model_copy(update={k: v for k, v in values.items() if v})

    def _ttl(self) -> float:
        if self._ttl_seconds is not None:
            return self._ttl_seconds
        agent, verifier = 3600.0, 600.0
        task_dir = self._task_dir()
        if task_dir is not None:
            try:
                config = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
                agent = float(config.get("agent", {}).get("timeout_sec") or agent)
                verifier = float(config.get("verifier", {}).get("timeout_sec") or verifier)
            except (OSError, ValueError, TypeError, AttributeError):
                pass
        # Harbor may stretch timeouts (--timeout-multiplier): leave it room
        return 4 * (agent + verifier) + self.task_env_config.build_timeout_sec

    async def start(self, force_build: bool) -> None:
        assert self._image is not None
        policy = self.network_policy
        network = harbor_network(policy.network_mode.value, policy.allowed_hosts, "network policy")
        self._sandbox = await AsyncSandbox.create(
            self.session_id[:128],
            from_template=self._image.template,
            limits=self._limits(),
            network=network,
            ttl_seconds=self._ttl(),
            provider=get_provider(self._provider_name),
        )
        self.logger.info(
            f"rollbox sandbox {self._sandbox.id} ({self._provider_name}, template "
            f"{self._sandbox.template_id}) for {self.session_id}"
        )
        probe = await self._sandbox.commands.run("command -v bash", cwd="/", timeout_seconds=30)
        self._shell = probe.stdout.strip() if probe.ok else None
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:  # nothing of a sandbox outlives its trial, whatever ``delete``
            await sandbox.kill()

    def _live(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise RuntimeError(f"{self.session_id}: the environment is not started")
        return self._sandbox

    # -- commands and files -----------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        sandbox = self._live()
        assert self._image is not None
        # Harbor's Docker environment runs commands with bash -c; so do we, where there is bash
        wrapped = f"exec {self._shell} -c {shlex.quote(command)}" if self._shell else command
        callback = self._output_callback()
        streams: dict[str, Any] = {}
        if callback is not None:
            streams = {
                "on_stdout": lambda text: callback(text, "stdout"),
                "on_stderr": lambda text: callback(text, "stderr"),
            }
        merged = self._merge_env(env)
        if self._verifier_home is not None:
            merged = {"HOME": self._verifier_home, **(merged or {})}
        result = await sandbox.commands.run(
            wrapped,
            cwd=cwd or self.task_env_config.workdir or self._image.workdir,
            env=merged,
            timeout_seconds=timeout_sec or None,
            **streams,
        )
        if result.timed_out:  # as Harbor's Docker environment reports it
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        code = result.exit_code
        if code < 0:  # killed by a signal: report it as a shell would (137 for SIGKILL)
            code = 128 - code
        return ExecResult(
            stdout=result.stdout or None, stderr=result.stderr or None, return_code=code
        )

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        await self._live().files.write(
            target_path, source.read_bytes(), mode=source.stat().st_mode & 0o777
        )

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        sandbox = self._live()
        if posixpath.normpath(target_dir) == TESTS_DIR:
            # The verifier is about to run: nothing the agent left running or wrote in /tests
            # may meet the tests.
            await sandbox.commands.kill_all()
            problem = await _fresh_directory(sandbox, TESTS_DIR)
            if problem is not None:
                raise RuntimeError(problem)
            # Harbor removed the reward files before this upload, while the agent's processes
            # could still write them: remove them again now that none can.
            logs = shlex.quote(VERIFIER_LOGS_DIR)
            cleared = await sandbox.commands.run(
                f"if [ -L {logs} ] || [ ! -d {logs} ]; then rm -rf {logs}; fi; mkdir -p {logs} "
                f"&& rm -rf {logs}/reward.txt {logs}/reward.json",
                cwd="/",
                timeout_seconds=60,
            )
            if not cleared.ok:
                raise RuntimeError(f"could not clear {VERIFIER_LOGS_DIR}: {cleared.stderr.strip()}")
            # and the verifier's commands get a HOME the agent never wrote to
            home = verifier_home()
            problem = await _fresh_directory(sandbox, home)
            if problem is not None:
                raise RuntimeError(problem)
            self._verifier_home = home
        else:
            made = await sandbox.commands.run(f"mkdir -p {shlex.quote(target_dir)}", cwd="/")
            if not made.ok:
                raise RuntimeError(f"mkdir {target_dir}: {made.stderr.strip()}")
        await sandbox.files.upload_dir(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._live().files.read(source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._live().files.download_dir(source_dir, target_dir)
