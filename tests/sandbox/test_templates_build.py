"""Declarative templates: validation, digests, local layered builds, Docker builds and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollbox import AsyncSandbox, ConfigError, Template, TemplateBuildError
from rollbox.sandbox import templates
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.templates import (
    AptStep,
    CopyStep,
    EnvStep,
    PipStep,
    RunStep,
    WorkdirStep,
    build_local,
    short,
)
from tests.sandbox._docker import docker_provider

__all__ = ["docker_provider"]  # the fixture, imported for pytest


@pytest.fixture
def context(tmp_path: Path) -> Path:
    """Host files that copy steps take: world-readable, like a project checkout."""
    directory = tmp_path / "context"
    (directory / "pkg").mkdir(parents=True)
    (directory / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (directory / "tool.sh").write_text("#!/bin/sh\necho tool ran\n")
    (directory / "tool.sh").chmod(0o755)
    return directory


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Builds of this module go to a cache of their own (the python base is rebuilt: ~1 s)."""
    root = Path("/var/tmp") / f"rollbox-test-cache-{os.getpid()}"
    root.mkdir(mode=0o755, exist_ok=True)
    old = os.environ.get("ROLLBOX_CACHE_DIR")
    os.environ["ROLLBOX_CACHE_DIR"] = str(root)
    yield
    if old is None:
        del os.environ["ROLLBOX_CACHE_DIR"]
    else:
        os.environ["ROLLBOX_CACHE_DIR"] = old


@pytest.fixture(scope="module", autouse=True)
def _remove_cache() -> Iterator[None]:
    yield
    subprocess.run(["rm", "-rf", f"/var/tmp/rollbox-test-cache-{os.getpid()}"], check=True)


def tool_template(context: Path, name: str = "tool") -> Template:
    return Template(
        name=name,
        base="python",
        steps=[
            RunStep(run="mkdir -p /opt/tool && echo built > /opt/tool/marker"),
            EnvStep(env={"TOOL_HOME": "/opt/tool", "GREETING": "hello world"}),
            WorkdirStep(workdir="/opt/tool"),
            RunStep(run='pwd > where && echo "$TOOL_HOME" >> where && rm -rf /usr/share/doc'),
            CopyStep(src=str(context), to="src"),
        ],
    )


def test_definitions_are_validated_with_the_field_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"steps\.0"):
        Template.parse({"name": "x", "steps": [{"apt": []}]})
    with pytest.raises(ConfigError, match="name"):
        Template.parse({"name": "has space", "steps": []})
    with pytest.raises(ConfigError, match=r"steps\.0"):
        Template.parse({"name": "x", "steps": [{"run": "true", "pip": ["x"]}]})
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[[steps]]\nnot_a_step = 1\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: invalid template"):
        Template.from_file(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid"):
        Template.from_file(broken)
    with pytest.raises(ConfigError, match="apt steps need a Debian base"):
        build_local(Template(name="x", steps=[AptStep(apt=["git"])]))
    with pytest.raises(ConfigError, match="pip steps need a base with pip"):
        build_local(Template(name="x", steps=[PipStep(pip=["six"])]))


def test_digest_is_the_definition_and_the_copied_files(context: Path, tmp_path: Path) -> None:
    first = tool_template(context)
    digest = first.digest
    assert digest == tool_template(context, name="renamed").digest  # names are labels
    assert digest != Template(name="tool", steps=first.steps[:-1]).digest
    (context / "pkg" / "__init__.py").write_text("VALUE = 43\n")
    assert first.digest != digest  # a copied file changed: the same definition, another digest
    loaded = tmp_path / "template.toml"
    loaded.write_text(
        'name = "tool"\nbase = "python"\n'
        '[[steps]]\nrun = "mkdir -p /opt/tool && echo built > /opt/tool/marker"\n'
        '[[steps]]\nenv = { TOOL_HOME = "/opt/tool", GREETING = "hello world" }\n'
        '[[steps]]\nworkdir = "/opt/tool"\n'
        "[[steps]]\nrun = 'pwd > where && echo \"$TOOL_HOME\" >> where && rm -rf /usr/share/doc'\n"
        f'[[steps]]\ncopy = "{os.path.relpath(context, tmp_path)}"\nto = "src"\n'
    )
    assert Template.from_file(loaded).digest == tool_template(context).digest
    assert short(digest).startswith("tpl-") and len(short(digest)) == 20


async def test_local_build_layers_steps_and_sandboxes_use_them(context: Path) -> None:
    template = tool_template(context)
    log: list[str] = []
    built = build_local(template, log.append)
    assert [line for line in log if line.startswith("step ")] == [
        f"step {i}/5 ({templates.describe(step)})" for i, step in enumerate(template.steps, 1)
    ]
    assert built.identity == short(template.digest) and len(built.layers) == 6
    again: list[str] = []
    assert build_local(template, again.append) == built
    assert again == [f"tool: cached ({built.identity})"]

    provider = LocalProvider()
    try:
        for source in (template, "tool", built.identity):
            async with await AsyncSandbox.create(from_template=source, provider=provider) as sb:
                assert sb.template_id == built.identity
                seen = await sb.commands.run(
                    'cat /opt/tool/marker /opt/tool/where; echo "$GREETING"; '
                    'python3 -B -c \'import sys; sys.path.insert(0, "/opt/tool/src"); '
                    "import pkg; print(pkg.VALUE)'; /opt/tool/src/tool.sh; "
                    "ls /usr/share/doc 2>&1 >/dev/null | wc -l"
                )
                assert seen.stdout == (
                    "built\n/opt/tool\n/opt/tool\nhello world\n42\ntool ran\n1\n"
                ), seen
                # the template's layers are the system: read-only for the sandbox user
                denied = await sb.commands.run("touch /opt/tool/marker")
                assert denied.exit_code != 0
                assert (await sb.commands.run("echo mine > /work/w && cat /work/w")).ok
        # a later step changed: the layers below it are reused
        changed = Template(name="tool2", steps=[*template.steps, RunStep(run="true")])
        more: list[str] = []
        build_local(changed, more.append)
        assert sum("cached" in line for line in more) == 5
    finally:
        await provider.close()


def test_failing_step_is_named_with_its_output(context: Path) -> None:
    template = Template(
        name="broken",
        steps=[
            RunStep(run="echo fine"),
            RunStep(run="echo 'about to fail' && echo 'on stderr' >&2 && exit 7"),
        ],
    )
    with pytest.raises(TemplateBuildError) as raised:
        build_local(template)
    message = str(raised.value)
    assert "step 2/2 (run echo 'about to fail'" in message and "exit 7" in message
    assert "about to fail" in message and "on stderr" in message
    assert templates.find_local_template("broken") is None


def test_cli_builds_lists_and_removes(context: Path, tmp_path: Path) -> None:
    definition = tmp_path / "cli.toml"
    definition.write_text(
        'name = "cli-tool"\n[[steps]]\nrun = "echo from-the-build-log"\n'
        f'[[steps]]\ncopy = "{context}"\nto = "/opt/src"\n'
    )
    command = [sys.executable, "-m", "rollbox", "template"]
    built = subprocess.run(
        [*command, "build", str(definition)], capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, built.stderr
    assert "step 1/2 (run echo from-the-build-log)" in built.stdout
    assert "    from-the-build-log" in built.stdout  # the build log, indented under its step
    listed = subprocess.run([*command, "ls"], capture_output=True, text=True, timeout=60)
    assert "cli-tool" in listed.stdout and "tpl-" in listed.stdout
    removed = subprocess.run(
        [*command, "rm", "cli-tool"], capture_output=True, text=True, timeout=60
    )
    assert removed.returncode == 0 and "removed tpl-" in removed.stdout
    assert templates.find_local_template("cli-tool") is None
    missing = subprocess.run(
        [*command, "rm", "cli-tool"], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "no template 'cli-tool'" in missing.stderr
    failing = tmp_path / "failing.toml"
    failing.write_text('name = "failing"\n[[steps]]\nrun = "echo the-output; exit 3"\n')
    failed = subprocess.run(
        [*command, "build", str(failing)], capture_output=True, text=True, timeout=60
    )
    assert failed.returncode == 1
    assert "step 1/1 (run echo the-output; exit 3) failed" in failed.stderr
    assert "the-output" in failed.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_debian_base_with_apt_and_pip() -> None:
    """debootstrap from the Debian mirror, then apt and pip with the host's network."""
    template = Template(
        name="debian-tools",
        base="debian:bookworm",
        steps=[AptStep(apt=["python3-pip", "jq"]), PipStep(pip=["six==1.16.0"])],
    )
    provider = LocalProvider()
    try:
        async with await AsyncSandbox.create(from_template=template, provider=provider) as sb:
            seen = await sb.commands.run(
                "jq --version && python3 -c 'import six; print(six.__version__)' && "
                "cat /etc/debian_version | cut -d. -f1"
            )
            assert seen.stdout == "jq-1.6\n1.16.0\n12\n", seen
            assert sb.template_id == short(template.digest)
    finally:
        await provider.close()


@pytest.mark.docker
async def test_docker_builds_the_same_template(docker_provider: object, context: Path) -> None:
    from rollbox.sandbox.docker import DockerProvider

    assert isinstance(docker_provider, DockerProvider)
    template = tool_template(context, name="docker-tool")
    log: list[str] = []
    image = await docker_provider.build_template(template, log.append)
    assert image.template_id == short(template.digest)  # the same identity on both backends
    try:
        async with await AsyncSandbox.create(
            from_template=template, provider=docker_provider
        ) as sb:
            assert sb.template_id == short(template.digest)
            seen = await sb.commands.run(
                'cat /opt/tool/marker /opt/tool/where; echo "$GREETING"; /opt/tool/src/tool.sh'
            )
            assert seen.stdout == "built\n/opt/tool\n/opt/tool\nhello world\ntool ran\n", seen
        async with await AsyncSandbox.create(
            from_template="docker-tool", provider=docker_provider
        ) as sb:
            assert sb.template_id == short(template.digest)
        names = [t["name"] for t in await docker_provider.list_templates()]
        assert "docker-tool" in names
        broken = Template(name="docker-broken", steps=[RunStep(run="echo said-this; exit 4")])
        with pytest.raises(TemplateBuildError) as raised:
            await docker_provider.build_template(broken)
        assert "step 1/1 (run echo said-this; exit 4) failed" in str(raised.value)
        assert "said-this" in str(raised.value)
    finally:
        assert await docker_provider.remove_template("docker-tool")
    assert await docker_provider.find_template("docker-tool") is None


def test_one_template_built_by_many_threads_at_once(context: Path) -> None:
    """Sandboxes of one process may build the same template together (Harbor tasks that share
    an environment do): every build succeeds with the same layers, and its manifest is whole."""
    template = tool_template(context, name="together")
    with ThreadPoolExecutor(4) as pool:
        built = list(pool.map(lambda _: build_local(template), range(4)))
    assert len({b.layers for b in built}) == 1
    # the manifest step itself, hammered: each write replaces the file with a whole one
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: templates._write_manifest(built[0], built[0].digest), range(200)))
    assert build_local(template).layers == built[0].layers
