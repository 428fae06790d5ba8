"""Provider names to classes; third parties add theirs through the ``rollbox.providers`` entry points."""

from __future__ import annotations

import asyncio
import importlib
import weakref
from importlib.metadata import entry_points

from rollbox.errors import ProviderNotFoundError
from rollbox.sandbox.base import Provider

# name -> ("module:Class", the pip extra that brings its dependencies)
_BUILTIN: dict[str, tuple[str, str | None]] = {
    "local": ("rollbox.sandbox.local:LocalProvider", None),
    "docker": ("rollbox.sandbox.docker:DockerProvider", "docker"),
    "remote": ("rollbox.sandbox.remote:RemoteProvider", None),  # httpx only; the server: [server]
    "ray": ("rollbox.sandbox.ray:RayProvider", "ray"),
}

# One default instance per provider name and event loop: providers hold loop-bound state.
_DEFAULTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Provider]] = (
    weakref.WeakKeyDictionary()
)


def provider_names() -> list[str]:
    """Every provider name known here, built-in and from entry points."""
    names = set(_BUILTIN)
    names.update(ep.name for ep in entry_points(group="rollbox.providers"))
    return sorted(names)


def provider_class(name: str) -> type[Provider]:
    """The class registered under ``name``."""
    target, extra = _BUILTIN.get(name, (None, None))
    if target is None:
        for ep in entry_points(group="rollbox.providers"):
            if ep.name == name:
                target = ep.value
                break
    if target is None:
        raise ProviderNotFoundError(
            f"unknown provider {name!r}; known: {', '.join(provider_names())}"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f": pip install 'rollbox[{extra}]'" if extra else ""
        raise ProviderNotFoundError(f"provider {name!r} cannot load ({exc}){hint}") from exc
    cls = getattr(module, attr)
    if not (isinstance(cls, type) and issubclass(cls, Provider)):
        raise ProviderNotFoundError(f"{target} is not a rollbox Provider")
    return cls


def get_provider(name: str) -> Provider:
    """The default instance of provider ``name`` for the running event loop."""
    loop = asyncio.get_running_loop()
    per_loop = _DEFAULTS.setdefault(loop, {})
    provider = per_loop.get(name)
    if provider is None:
        provider = per_loop[name] = provider_class(name)()
    return provider
