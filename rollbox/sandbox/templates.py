"""Templates: a declarative environment (base + steps), built once and cached by its digest.

A :class:`Template` is pure data (pydantic), so it is the same in Python, in a TOML file and on
the wire::

    Template(name="pytools", base="debian:bookworm", steps=[
        AptStep(apt=["git"]), PipStep(pip=["pytest==8.3.3"]), RunStep(run="git --version"),
    ])

Bases:

- ``"python"``: the host's own Python and tools (the same files the local ``python`` template
  shows), copied into a small root filesystem;
- ``"debian:SUITE"``: Debian SUITE (minbase, with python3) made by ``debootstrap`` from the
  Debian mirror (``ROLLBOX_DEBIAN_MIRROR``, default ``http://deb.debian.org/debian``);
- anything else: the absolute path of a root filesystem directory (local backend) or a Docker
  image (Docker backend).

The local backend builds each step into a layer directory (an overlay upper dir) on top of the
previous ones; a sandbox stacks them read-only (``--overlay-src``) under its own writable layer.
Layers are cached by a digest of everything below them, so templates that share a prefix share
its layers, and a template is built once. The Docker backend builds the same steps into an
image (``docker.py``). Build steps are written by the operator, not by a model: they run as root
in a chroot of the layer stack (a private mount and pid namespace) with the host's network, as
``docker build`` runs them. The layers they make are owned by root: sandboxed code (uid 65534)
reads them and writes only to ``/work``, ``/tmp`` and directories a step gave it (``chown
65534``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rollbox.errors import BackendUnavailableError, ConfigError, TemplateBuildError
from rollbox.sandbox import _host

BUILDER_VERSION = "1"  # part of every digest: bump when a build's output would change
SANDBOX_UID = 65534
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BuildLog = Callable[[str], None]


class _Step(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AptStep(_Step):
    """Install Debian packages (needs a Debian base)."""

    apt: tuple[str, ...] = Field(min_length=1)


class PipStep(_Step):
    """Install Python packages with the base's ``python3 -m pip``."""

    pip: tuple[str, ...] = Field(min_length=1)


class RunStep(_Step):
    """Run a shell command as root."""

    run: str = Field(min_length=1)


class CopyStep(_Step):
    """Copy a host file or directory (``copy`` in files and on the wire) to ``to``."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    src: str = Field(min_length=1, alias="copy")
    to: str = Field(min_length=1)


class EnvStep(_Step):
    """Set environment variables for later steps and for every command of its sandboxes."""

    env: dict[str, str] = Field(min_length=1)

    @field_validator("env")
    @classmethod
    def _check_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not key or "=" in key or "\0" in key or not key.replace("_", "a").isalnum():
                raise ValueError(f"environment variable name {key!r} is invalid")
        return env


class WorkdirStep(_Step):
    """The directory later steps run in (created if missing); relative ``to`` paths start here."""

    workdir: str = Field(min_length=1)


Step = AptStep | PipStep | RunStep | CopyStep | EnvStep | WorkdirStep


class Template(BaseModel):
    """A sandbox environment: a base plus build steps, identified by :attr:`digest`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
    base: str = "python"
    steps: tuple[Step, ...] = ()

    @field_validator("base")
    @classmethod
    def _check_base(cls, base: str) -> str:
        if not base or "\0" in base or base != base.strip():
            raise ValueError(f"base {base!r} is not a template base")
        return base

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Template:
        """Load a template from a TOML or JSON file; ``copy`` paths are relative to the file.

        Raises:
            ConfigError: the file is missing or invalid; the message names the field.
        """
        import tomllib

        source = Path(path)
        try:
            text = source.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read template file {source}: {exc}") from exc
        try:
            data = json.loads(text) if source.suffix == ".json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{source}: not valid {source.suffix or 'TOML'}: {exc}") from exc
        steps = data.get("steps", [])
        if isinstance(steps, list):
            for step in steps:
                if isinstance(step, dict) and isinstance(step.get("copy"), str):
                    step["copy"] = str((source.parent / step["copy"]).resolve())
        return cls.parse(data, where=str(source))

    @classmethod
    def parse(cls, data: Any, *, where: str = "template") -> Template:
        """Validate a template definition; errors name the field (``steps.2.apt``)."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc']) or 'template'}: {error['msg']}"
                for error in exc.errors()[:5]
            )
            raise ConfigError(f"{where}: invalid template ({problems})") from exc

    @property
    def digest(self) -> str:
        """The template's identity: a digest of its base, its steps and the files it copies."""
        return layer_digests(self)[-1]

    @property
    def env(self) -> dict[str, str]:
        """The environment its env steps set, in order."""
        env: dict[str, str] = {}
        for step in self.steps:
            if isinstance(step, EnvStep):
                env.update(step.env)
        return env


def layer_digests(template: Template) -> list[str]:
    """The digest of the base, then of each step on top of everything below it."""
    digest = _sha(f"rollbox-template-v{BUILDER_VERSION}\0base\0{base_identity(template.base)}")
    digests = [digest]
    for step in template.steps:
        payload = step.model_dump_json(by_alias=True)
        if isinstance(step, CopyStep):
            payload += "\0" + _content_digest(Path(step.src))
        digest = _sha(f"{digest}\0{payload}")
        digests.append(digest)
    return digests


def short(digest: str) -> str:
    """The digest as shown to people and used in names: ``tpl-`` and 16 hex digits."""
    return f"tpl-{digest[:16]}"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _content_digest(path: Path) -> str:
    """A digest of a host file or tree: relative names, modes and contents (links skipped)."""
    if not path.exists():
        raise ConfigError(f"copy step: {path} does not exist on this machine")
    hasher = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if not p.is_symlink())
    for file in files:
        relative = file.relative_to(path).as_posix() if file != path else "."
        mode = file.stat().st_mode
        hasher.update(f"{relative}\0{mode & 0o7777:o}\0{file.is_dir()}\0".encode())
        if file.is_file():
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    hasher.update(block)
    return hasher.hexdigest()


def base_identity(base: str) -> str:
    """What a base is, for digests: the host's python files, a Debian suite, a path or image."""
    if base == "python":
        return f"python-host:{host_python_fingerprint()}"
    return base


def debian_suite(base: str) -> str | None:
    """``"bookworm"`` for ``"debian:bookworm"``; None for other bases."""
    if base.startswith("debian:"):
        suite = base.removeprefix("debian:")
        if not suite.replace("-", "").isalnum():
            raise ConfigError(f"base {base!r}: the Debian suite must be a name like 'bookworm'")
        return suite
    return None


# -- shell commands of the steps (the same on both backends) ----------------------------------


def step_command(step: Step) -> str | None:
    """The shell command a step runs (None for steps that only copy or set state)."""
    if isinstance(step, AptStep):
        packages = " ".join(shlex.quote(p) for p in step.apt)
        return (
            "export DEBIAN_FRONTEND=noninteractive && apt-get update -q && "
            f"apt-get install -y -q --no-install-recommends {packages} && "
            "rm -rf /var/lib/apt/lists/*"
        )
    if isinstance(step, PipStep):
        packages = " ".join(shlex.quote(p) for p in step.pip)
        return (
            "PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_CACHE_DIR=1 "
            f"PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip install {packages}"
        )
    if isinstance(step, RunStep):
        return step.run
    return None


def describe(step: Step) -> str:
    """One line naming a step, for logs and errors."""
    if isinstance(step, AptStep):
        return "apt " + " ".join(step.apt)
    if isinstance(step, PipStep):
        return "pip " + " ".join(step.pip)
    if isinstance(step, RunStep):
        return "run " + step.run.splitlines()[0][:100]
    if isinstance(step, CopyStep):
        return f"copy {step.src} -> {step.to}"
    if isinstance(step, EnvStep):
        return "env " + " ".join(f"{k}={v}" for k, v in step.env.items())
    return f"workdir {step.workdir}"


def check_steps_fit_base(template: Template) -> None:
    """Refuse apt and pip steps on the python base (it has neither), before anything is built."""
    if template.base == "python" and any(isinstance(s, AptStep) for s in template.steps):
        raise ConfigError(
            f"template {template.name!r}: apt steps need a Debian base (base = "
            "'debian:bookworm'); the 'python' base is the host's Python without apt"
        )
    if template.base == "python" and any(isinstance(s, PipStep) for s in template.steps):
        raise ConfigError(
            f"template {template.name!r}: pip steps need a base with pip: base = "
            "'debian:bookworm' with an apt step for python3-pip first (the 'python' base is "
            "the host's Python and standard library, without pip)"
        )


# -- the cache ----------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where built layers and template manifests live (``ROLLBOX_CACHE_DIR`` overrides)."""
    configured = os.environ.get("ROLLBOX_CACHE_DIR")
    if configured:
        path = Path(configured)
    elif os.geteuid() == 0:
        path = Path("/var/cache/rollbox")
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rollbox"
    return path


def _ensure_dir(path: Path) -> Path:
    """A directory the sandbox user can traverse (bwrap opens layers as that user)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o755)
    return path


class BuiltTemplate(BaseModel):
    """A template built by the local backend: its layers (lowest first) and environment."""

    model_config = ConfigDict(frozen=True)

    name: str
    digest: str
    layers: tuple[str, ...]
    env: dict[str, str]
    definition: Template
    built_at: datetime
    size_bytes: int

    @property
    def identity(self) -> str:
        return short(self.digest)


def _manifest_dir() -> Path:
    return cache_dir() / "templates"


def _layers_dir() -> Path:
    return cache_dir() / "layers"


def list_local_templates() -> list[BuiltTemplate]:
    """Every template the local backend has built, newest first."""
    built = []
    for path in sorted(_manifest_dir().glob("*.json")) if _manifest_dir().is_dir() else ():
        with contextlib.suppress(OSError, ValueError):
            built.append(BuiltTemplate.model_validate_json(path.read_text()))
    return sorted(built, key=lambda b: b.built_at, reverse=True)


def find_local_template(name_or_digest: str) -> BuiltTemplate | None:
    """A built template by name (the newest build) or by (short) digest."""
    wanted = name_or_digest.removeprefix("tpl-")
    for built in list_local_templates():
        if built.name == name_or_digest or (len(wanted) >= 8 and built.digest.startswith(wanted)):
            return built
    return None


def remove_local_template(name_or_digest: str) -> list[str]:
    """Remove a template's manifests and the layers no other template uses; returns digests."""
    target = find_local_template(name_or_digest)
    if target is None:
        return []
    removed = [
        b
        for b in list_local_templates()
        if b.digest == target.digest or (b.name == target.name and b.name == name_or_digest)
    ]
    for built in removed:
        with contextlib.suppress(FileNotFoundError):
            (_manifest_dir() / f"{built.digest}.json").unlink()
    still_used = {layer for built in list_local_templates() for layer in built.layers}
    for built in removed:
        for layer in built.layers:
            path = Path(layer)
            if layer not in still_used and path.parent == _layers_dir() and path.exists():
                shutil.rmtree(path, ignore_errors=True)
    return [built.digest for built in removed]


# -- bases --------------------------------------------------------------------------------------

# Commands the python base offers besides Python itself: what shell scripts and the tests use.
HOST_TOOLS = (
    "sh", "bash", "dash", "env", "cat", "ls", "cp", "mv", "rm", "mkdir", "rmdir", "ln", "chmod",
    "touch", "echo", "printf", "head", "tail", "wc", "tr", "sort", "uniq", "cut", "grep", "sed",
    "awk", "find", "xargs", "sleep", "setsid", "nohup", "kill", "ps", "timeout", "date",
    "dirname", "basename", "pwd", "true", "false", "test", "tee", "diff", "cmp", "tar", "gzip",
    "id", "whoami", "uname", "stat", "readlink", "realpath", "mktemp", "seq", "expr", "yes", "od",
    "md5sum", "sha256sum", "du", "df", "nproc", "which", "paste", "comm", "split", "chown",
)  # fmt: skip
_SKIP_STDLIB = {"test", "site-packages", "dist-packages", "idlelib", "tkinter", "turtledemo"}
_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


@functools.cache
def _host_python_files() -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(files, directories to copy whole, interpreter) of the host's python base."""
    python = _host.template_python()
    stdlib = subprocess.run(
        [python, "-I", "-S", "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    binaries = [python]
    for tool in HOST_TOOLS:
        found = shutil.which(tool, path=_SYSTEM_PATH)
        if found:
            binaries.append(found)
    files = set(binaries)
    for dynload in Path(stdlib, "lib-dynload").glob("*.so"):
        files.add(str(dynload))
    libraries: set[str] = set()
    chunk = 64
    ordered = sorted(files)
    for start in range(0, len(ordered), chunk):
        out = subprocess.run(
            ["ldd", *ordered[start : start + chunk]], capture_output=True, text=True
        ).stdout
        for line in out.splitlines():
            parts = line.split()
            for part in parts:
                if part.startswith("/") and os.path.exists(part):
                    libraries.add(part)
    return tuple(sorted(files | libraries)), (stdlib,), python


@functools.cache
def host_python_fingerprint() -> str:
    """A digest of the host files the python base copies (names, sizes, mtimes)."""
    files, trees, python = _host_python_files()
    hasher = hashlib.sha256(f"{BUILDER_VERSION}\0{python}".encode())
    for name in files:
        st = os.stat(name)
        hasher.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for tree in trees:
        st = os.stat(tree)
        hasher.update(f"{tree}\0{st.st_mtime_ns}\0".encode())
    return hasher.hexdigest()[:24]


def _copy_host_file(source: str, root: Path) -> None:
    """Copy ``source`` to the same path under ``root``, with its chain of symlinks."""
    path = Path(source)
    for _ in range(16):
        target = root / path.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            link = os.readlink(path)
            if not target.exists() and not target.is_symlink():
                os.symlink(link, target)
            path = (path.parent / link).resolve() if not os.path.isabs(link) else Path(link)
            continue
        if not target.exists():
            shutil.copy2(path, target)
        return


def build_host_python_rootfs(root: Path) -> None:
    """Fill ``root`` with the host's Python, its stdlib, the tools in HOST_TOOLS and their libs."""
    files, trees, python = _host_python_files()
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():  # merged /usr: the same links, to directories that exist
            link = os.readlink(host)
            (root / name).parent.joinpath(link).mkdir(parents=True, exist_ok=True)
            os.symlink(link, root / name)
    for source in files:
        _copy_host_file(source, root)
    for tree in trees:
        shutil.copytree(
            tree,
            root / Path(tree).relative_to("/"),
            symlinks=True,
            ignore=lambda d, names: [n for n in names if n in _SKIP_STDLIB],
            dirs_exist_ok=True,
        )
    usr_bin = root / "usr/bin"
    usr_bin.mkdir(parents=True, exist_ok=True)
    for alias in ("python3", "python"):
        link = usr_bin / alias
        if not link.exists() and not link.is_symlink():
            os.symlink(python, link)
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nsandbox:x:65534:65534:sandbox:/work:/bin/bash\n"
    )
    (etc / "group").write_text("root:x:0:\nsandbox:x:65534:\n")
    (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    for name in ("ld.so.cache", "ld.so.conf", "ssl/certs/ca-certificates.crt"):
        host = Path("/etc") / name
        if host.is_file():
            (etc / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(host, etc / name)
    for name, mode in (("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("tmp", 0o1777),
                       ("var/tmp", 0o1777), ("root", 0o700), ("work", 0o755), ("home", 0o755)):  # fmt: skip
        (root / name).mkdir(parents=True, exist_ok=True)
        os.chmod(root / name, mode)
    os.chown(root / "work", SANDBOX_UID, SANDBOX_UID)


def build_debian_rootfs(suite: str, root: Path, log: BuildLog) -> None:
    """Debian ``suite`` (minbase, python3) by debootstrap from the mirror."""
    debootstrap = shutil.which("debootstrap", path=_SYSTEM_PATH)
    if debootstrap is None:
        raise BackendUnavailableError(
            "the 'debian:*' template bases are made with debootstrap: apt-get install debootstrap"
        )
    if os.geteuid() != 0:
        raise BackendUnavailableError("debootstrap needs root to make a Debian base")
    mirror = os.environ.get("ROLLBOX_DEBIAN_MIRROR", DEBIAN_MIRROR)
    argv = [debootstrap, "--variant=minbase", "--include=python3", suite, str(root), mirror]
    _run_logged(argv, log, f"debootstrap {suite}", env={"PATH": _SYSTEM_PATH, "LANG": "C"})
    (root / "work").mkdir(exist_ok=True)
    os.chown(root / "work", SANDBOX_UID, SANDBOX_UID)
    with contextlib.suppress(FileNotFoundError):
        (root / "etc/resolv.conf").unlink()  # the host's, copied by debootstrap
    (root / "etc/resolv.conf").touch()
    # the apt cache debootstrap leaves: 20+ MB no sandbox needs
    for leftover in (root / "var/cache/apt/archives").glob("*.deb"):
        leftover.unlink()


def _run_logged(argv: list[str], log: BuildLog, what: str, env: dict[str, str]) -> None:
    """Run a build command, sending each output line to ``log``; raise with the output tail."""
    tail: list[str] = []
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        text=True,
        errors="replace",
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            log(line.rstrip("\n"))
            tail.append(line.rstrip("\n"))
            del tail[:-40]
        code = process.wait()
    if code != 0:
        output = "\n".join(tail)
        raise TemplateBuildError(f"{what} failed (exit {code}); its last output:\n{output}")


# -- the local builder --------------------------------------------------------------------------


def _dir_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


@contextlib.contextmanager
def _new_layer(digest: str) -> Iterator[tuple[Path, Path]]:
    """A scratch (layer, overlay work dir) pair, renamed into the cache on success."""
    layers = _ensure_dir(_layers_dir())
    final = layers / digest
    scratch = Path(
        _ensure_dir(layers / ".build") / f"{digest[:16]}-{os.getpid()}-{time.monotonic_ns()}"
    )
    scratch.mkdir()
    os.chmod(scratch, 0o755)
    upper, work = scratch / "layer", scratch / "work"
    upper.mkdir()
    work.mkdir()
    os.chmod(upper, 0o755)
    try:
        yield upper, work
        try:
            os.rename(upper, final)
        except OSError:
            if not final.is_dir():  # another process built it meanwhile: theirs is as good
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


_STEP_SCRIPT = r"""
set -e
merged="$1"; lower="$2"; upper="$3"; work="$4"; copy_src="$5"; ca="$6"; shift 6
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work,userxattr" "$merged"
for dir in proc dev sys; do [ -d "$merged/$dir" ] || mkdir -p "$merged/$dir"; done
mount -t proc proc "$merged/proc"
mount --rbind /dev "$merged/dev"
made_resolv=
if [ ! -e "$merged/etc/resolv.conf" ] && [ -d "$merged/etc" ]; then
    : > "$merged/etc/resolv.conf"; made_resolv=1
fi
[ -e "$merged/etc/resolv.conf" ] && mount --bind /etc/resolv.conf "$merged/etc/resolv.conf"
if [ -n "$copy_src" ]; then
    mkdir "$merged/.rollbox-copy"
    mount --bind "$copy_src" "$merged/.rollbox-copy"
fi
if [ -n "$ca" ]; then
    : > "$merged/.rollbox-ca.crt"
    mount --bind "$ca" "$merged/.rollbox-ca.crt"
fi
set +e
chroot "$merged" "$@"
code=$?
set -e
if [ -n "$copy_src" ]; then umount "$merged/.rollbox-copy"; rmdir "$merged/.rollbox-copy"; fi
if [ -n "$ca" ]; then umount "$merged/.rollbox-ca.crt"; rm -f "$merged/.rollbox-ca.crt"; fi
umount -l "$merged/etc/resolv.conf" 2>/dev/null || true
[ -n "$made_resolv" ] && rm -f "$merged/etc/resolv.conf"
exit $code
"""


# Build steps trust what the host trusts (e.g. a TLS-intercepting proxy's CA): its bundle is
# bound at /.rollbox-ca.crt for the step only, and these variables point TLS clients at it.
CA_IN_BUILD = "/.rollbox-ca.crt"
CA_ENV = {
    name: CA_IN_BUILD
    for name in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
}


def host_ca_bundle() -> Path | None:
    """The host's CA certificate bundle, if it has one."""
    import ssl

    for candidate in (os.environ.get("SSL_CERT_FILE"), ssl.get_default_verify_paths().cafile):
        if candidate and os.path.isfile(candidate):
            return Path(candidate)
    return None


def _run_step_in_chroot(
    lowers: list[Path],
    upper: Path,
    work: Path,
    command: str,
    cwd: str,
    env: dict[str, str],
    log: BuildLog,
    what: str,
    copy_src: Path | None = None,
) -> None:
    """Run ``command`` as root in a chroot of ``lowers`` + ``upper``, in private namespaces."""
    unshare = shutil.which("unshare", path=_SYSTEM_PATH)
    if unshare is None or os.geteuid() != 0:
        raise BackendUnavailableError(
            "building template steps on the local backend needs root and util-linux's unshare"
        )
    merged = Path(upper.parent / "merged")
    merged.mkdir(exist_ok=True)
    lower = ":".join(str(p) for p in reversed(lowers))  # overlayfs lists the top layer first
    ca = host_ca_bundle()
    step_env = {
        "PATH": _SYSTEM_PATH,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
        **(CA_ENV if ca else {}),
        **env,
    }
    script = f"mkdir -p {shlex.quote(cwd)} && cd {shlex.quote(cwd)} && {command}"
    argv = [
        unshare, "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
        "/bin/sh", "-c", _STEP_SCRIPT, "rollbox-step",
        str(merged), lower, str(upper), str(work), str(copy_src or ""), str(ca or ""),
        "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in step_env.items()), "/bin/sh", "-c", script,
    ]  # fmt: skip
    _run_logged(argv, log, what, env={"PATH": _SYSTEM_PATH, "LANG": "C"})


def build_local(template: Template, log: BuildLog | None = None) -> BuiltTemplate:
    """Build ``template`` into cached layers (each step once) and record its manifest.

    Raises:
        ConfigError: the template cannot be built on this base.
        TemplateBuildError: a step failed; the message names it and shows its output.
        BackendUnavailableError: no root, unshare or debootstrap where they are needed.
    """
    log = log or (lambda line: None)
    check_steps_fit_base(template)
    digests = layer_digests(template)
    manifest = _manifest_dir() / f"{digests[-1]}.json"
    if manifest.exists():
        with contextlib.suppress(OSError, ValueError):
            built = BuiltTemplate.model_validate_json(manifest.read_text())
            if all(Path(layer).is_dir() for layer in built.layers):
                if built.name != template.name:  # same definition under another name
                    built = built.model_copy(update={"name": template.name})
                    _write_manifest(built, digests[-1])
                log(f"{template.name}: cached ({short(built.digest)})")
                return built
    _ensure_dir(cache_dir())
    total = len(template.steps)
    layers: list[Path] = [_base_layer(template.base, digests[0], log)]
    env: dict[str, str] = {}
    cwd = "/"
    for index, (step, digest) in enumerate(zip(template.steps, digests[1:], strict=True), 1):
        what = f"step {index}/{total} ({describe(step)})"
        if isinstance(step, EnvStep):
            env.update(step.env)
        if isinstance(step, WorkdirStep):
            cwd = _join(cwd, step.workdir)
        final = _layers_dir() / digest
        if final.is_dir():
            log(f"{what}: cached")
            layers.append(final)
            continue
        log(f"{what}")
        with _new_layer(digest) as (upper, work):
            if isinstance(step, CopyStep):
                target = shlex.quote(_join(cwd, step.to))
                source = Path(step.src)
                if source.is_dir():
                    command = f"mkdir -p {target} && cp -R /.rollbox-copy/. {target}"
                else:
                    parent = shlex.quote(os.path.dirname(_join(cwd, step.to)))
                    command = f"mkdir -p {parent} && cp /.rollbox-copy/{shlex.quote(source.name)} {target}"
                mount_src = source if source.is_dir() else source.parent
                _run_step_in_chroot(
                    layers, upper, work, command, "/", env, log, what, copy_src=mount_src
                )
            elif isinstance(step, WorkdirStep):
                _run_step_in_chroot(layers, upper, work, "true", cwd, env, log, what)
            elif isinstance(step, EnvStep):
                pass  # an empty layer: the environment lives in the manifest
            else:
                command = step_command(step)
                assert command is not None
                _run_step_in_chroot(layers, upper, work, command, cwd, env, log, what)
        layers.append(final)
    built = BuiltTemplate(
        name=template.name,
        digest=digests[-1],
        layers=tuple(str(p) for p in layers),
        env=template.env,
        definition=template,
        built_at=datetime.now(UTC),
        size_bytes=sum(_dir_size(p) for p in layers[1:]),
    )
    _write_manifest(built, digests[-1])
    log(f"{template.name}: built {short(built.digest)}")
    return built


def _write_manifest(built: BuiltTemplate, digest: str) -> None:
    directory = _ensure_dir(_manifest_dir())
    _host.write_atomically(
        directory / f"{digest}.json", built.model_dump_json(indent=2, by_alias=True).encode()
    )


def _join(cwd: str, path: str) -> str:
    return os.path.normpath(os.path.join(cwd, path))


def _base_layer(base: str, digest: str, log: BuildLog) -> Path:
    """The lowest layer of a template: built (python, debian) and cached, or a given directory."""
    suite = debian_suite(base)
    if base != "python" and suite is None:
        path = Path(base)
        if not path.is_absolute() or not path.is_dir():
            raise ConfigError(
                f"template base {base!r} is neither 'python', 'debian:SUITE' nor the absolute "
                "path of a root filesystem directory (the local backend has no Docker images)"
            )
        return path
    final = _layers_dir() / digest
    if final.is_dir():
        return final
    log(f"base {base}: building" + (" with debootstrap (about a minute)" if suite else ""))
    with _new_layer(digest) as (upper, _work):
        if suite is not None:
            build_debian_rootfs(suite, upper, log)
        else:
            build_host_python_rootfs(upper)
    return final


def base_rootfs(base: str, log: BuildLog | None = None) -> Path:
    """The root filesystem directory of a built-in base (``python`` or ``debian:SUITE``)."""
    digest = _sha(f"rollbox-template-v{BUILDER_VERSION}\0base\0{base_identity(base)}")
    return _base_layer(base, digest, log or (lambda line: None))


# -- the Docker build context -------------------------------------------------------------------


def docker_build_context(template: Template, base_image: str) -> tuple[bytes, int]:
    """A tar with a generated Dockerfile (and the files of copy steps) for ``POST /build``.

    Also returns how many Dockerfile instructions come before the first step's (one each).
    """
    import tarfile

    lines = [f"FROM {base_image}", "USER root", 'SHELL ["/bin/sh", "-c"]']
    buffer = io.BytesIO()
    ca = host_ca_bundle()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        if ca is not None:  # run steps trust what the host trusts; the file is a public cert
            tar.add(ca, arcname="rollbox-ca.crt")
            lines.append(f"COPY rollbox-ca.crt {CA_IN_BUILD}")
        preamble = len(lines)
        cwd = "/"
        for index, step in enumerate(template.steps, 1):
            lines.append(f"# step {index}: {describe(step)}".replace("\n", " "))
            if isinstance(step, EnvStep):
                lines.append("ENV " + " ".join(f"{k}={json.dumps(v)}" for k, v in step.env.items()))
            elif isinstance(step, WorkdirStep):
                cwd = _join(cwd, step.workdir)
                lines.append(f"WORKDIR {json.dumps(cwd)}")
            elif isinstance(step, CopyStep):
                source = Path(step.src)
                name = f"copy-{index}"
                tar.add(source, arcname=name, filter=_no_links)
                lines.append(f"COPY {json.dumps([name, _join(cwd, step.to)])}")
            else:
                command = step_command(step) or ""
                if ca is not None:
                    variables = " ".join(f"{k}={v}" for k, v in CA_ENV.items())
                    command = f"{variables} sh -c {shlex.quote(command)}"
                lines.append(f"RUN {json.dumps(['/bin/sh', '-c', command])}")
        dockerfile = ("\n".join(lines) + "\n").encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
    return buffer.getvalue(), preamble


def _no_links(info: Any) -> Any:
    return None if info.issym() or info.islnk() else info


def write_rootfs_tar(root: Path, destination: Path) -> None:
    """Write a root filesystem directory as an uncompressed tar (for ``docker import``)."""
    import tarfile

    with tarfile.open(destination, "w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(root)):
            tar.add(root / entry, arcname=entry)
