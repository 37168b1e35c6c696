"""The plugin manager: everything optional (backends included) comes in through the ``ruvllm``
entry-point group. ``RUVLLM_PLUGINS`` (comma list of entry-point names) restricts what loads."""

from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass, field
from types import ModuleType

import pluggy
import structlog

from ruvllm import hookspecs
from ruvllm.backend import Backend, ExplainsUnavailable
from ruvllm.errors import BackendError

log = structlog.get_logger("ruvllm.plugins")

ENTRY_POINT_GROUP = "ruvllm"


@dataclass(frozen=True)
class PluginRecord:
    name: str
    version: str
    module: str
    hooks: tuple[str, ...] = ()
    error: str | None = None


@dataclass
class PluginHost:
    """A pluggy manager with the ruvllm hookspecs, plus what loading the plugins found."""

    pm: pluggy.PluginManager
    records: list[PluginRecord] = field(default_factory=list)
    backends: dict[str, Backend] = field(default_factory=dict)

    @property
    def hook(self) -> pluggy.HookRelay:
        return self.pm.hook

    def add_hookspecs(self, module: ModuleType | type) -> None:
        """Add the hook specifications a host package defines for its own hooks (the server's routes
        and parsers: ``ruvllm_server.hookspecs``), checking the plugins already registered against
        them. Adding the same module again does nothing."""
        names = [n for n in dir(module) if self.pm.parse_hookspec_opts(module, n) is not None]
        callers = [getattr(self.pm.hook, n, None) for n in names]
        if names and all(c is not None and c.has_spec() for c in callers):
            return
        self.pm.add_hookspecs(module)

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object (module or instance) directly, e.g. from tests or embedding code."""
        self.pm.register(plugin, name=name)
        self._collect_backends()

    def _collect_backends(self) -> None:
        found: dict[str, Backend] = {}

        def register(backend: Backend) -> None:
            missing = [a for a in ("name", "description", "available", "describe", "load") if not hasattr(backend, a)]
            if missing:
                raise BackendError(f"register_backends got {backend!r}, which has no {', '.join(missing)}")
            found[backend.name] = backend

        self.pm.hook.register_backends(register=register)
        self.backends = found

    def choose_backend(self, requested: str | None = None) -> Backend:
        """The backend named by ``requested`` / ``RUVLLM_BACKEND``, else the best available one."""
        name = requested or os.environ.get("RUVLLM_BACKEND") or None
        if name:
            info = self.backends.get(name)
            if info is None:
                known = ", ".join(sorted(self.backends)) or "none installed"
                raise BackendError(f"unknown backend {name!r} (installed: {known})")
            if not info.available():
                reason = info.unavailable_reason() if isinstance(info, ExplainsUnavailable) else None
                raise BackendError(
                    f"backend {name!r} is installed but cannot run on this machine" + (f": {reason}" if reason else "")
                )
            return info
        usable = [b for b in self.backends.values() if b.available()]
        if not usable:
            raise BackendError(
                "no ruvllm backend is installed: pip install ruvllm-backend-jax or ruvllm-backend-candle-compat"
            )
        return max(usable, key=lambda b: getattr(b, "priority", 0))


def _hooks_of(pm: pluggy.PluginManager, plugin: object) -> tuple[str, ...]:
    return tuple(sorted(h.name for h in (pm.get_hookcallers(plugin) or [])))


def load_plugins(allowed: str | None = None) -> PluginHost:
    """Build a :class:`PluginHost` from the installed entry points.

    ``allowed`` (default: ``RUVLLM_PLUGINS``) is a comma list of entry-point names; empty or unset
    means all. A plugin that fails to import is recorded with its error and skipped.
    """
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    allowed = os.environ.get("RUVLLM_PLUGINS") if allowed is None else allowed
    only = {p.strip() for p in allowed.split(",") if p.strip()} if allowed else None
    host = PluginHost(pm)
    seen: set[str] = set()
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen or (only is not None and ep.name not in only):
            continue
        seen.add(ep.name)
        version = ep.dist.version if ep.dist is not None else "?"
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not take the host down
            msg = f"{type(exc).__name__}: {exc}"
            log.warning("plugin failed to load", plugin=ep.name, error=msg)
            host.records.append(PluginRecord(ep.name, version, ep.value, error=msg))
            continue
        host.records.append(PluginRecord(ep.name, version, ep.value, hooks=_hooks_of(pm, plugin)))
    host._collect_backends()
    return host
