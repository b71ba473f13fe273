"""Plugins in tests: a plugin manager with one extra backend."""

from __future__ import annotations

from typing import Any, Callable, Mapping

# The environment switches of plugin loading (and the signing key): never inherited by a test.
PLUGIN_SWITCHES = ("ROLL_CKPT_DISABLE_PLUGIN_AUTOLOAD", "ROLL_CKPT_PLUGINS", "ROLL_CKPT_BLOCKED_PLUGINS",
                   "ROLL_CKPT_SIGNING_KEY")


def plugins_with_backend(backend: str, factory: Callable[[str, Mapping[str, Any]], Any], name: str) -> Any:
    """A fresh :class:`roll_ckpt.plugins.Plugins` plus the plugin ``name`` (distribution
    ``test-<name>``) whose backend ``backend`` opens storages with ``factory(url, options)``."""
    from roll_ckpt import BackendRecord, hookimpl
    from roll_ckpt.plugins import Plugins

    class _Plugin:
        @hookimpl
        def roll_ckpt_backends(self) -> list[BackendRecord]:
            return [BackendRecord(name=backend, factory=factory)]

    plugins = Plugins()
    plugins.register(_Plugin(), name=name, distribution=f"test-{name}")
    return plugins
