"""The roll-ckpt modules the documentation site reads, named in this one place.

The generated pages (configuration, command line, API) import nothing of roll-ckpt but
through these functions, so whoever moves a module fixes the name here and nowhere else
in ``docs/``. Each names the public or documented entry point it needs.
"""

from __future__ import annotations

import importlib
from types import ModuleType

CONFIG = "roll_ckpt.config.schema"  # Config and its section dataclasses, load_config
ROLL_DEFAULTS = "roll_ckpt.config.roll_defaults"  # ROLL_DEFAULTS, WORKER_ASYNC_DEFAULT
WORKER_STRATEGY = "roll_ckpt.config.roll_keys"  # WORKER_STRATEGY: where a ROLL worker keeps its strategy_config
PLUGINS = "roll_ckpt.plugins"  # get_plugins: plugin-owned config keys, plugin commands
CLI = "roll_ckpt.cli"  # build_parser: the roll-ckpt command line, plugins' commands included
HOOKSPECS = "roll_ckpt.hookspecs"  # the hooks a plugin implements
S3_RETRY = "roll_ckpt_fs.network"  # RetryPolicy, RETRY_KEYS: the file_system backend's storage_options on s3://

# Packages whose ``__all__`` is the public API the API page documents (plugins' included).
API_PACKAGES = ("roll_ckpt", "roll_ckpt.views", "roll_ckpt.errors", "roll_ckpt.config", "roll_ckpt.plugin",
                "roll_ckpt.testing", "roll_ckpt_fs", "roll_ckpt_fsdp2", "roll_ckpt_demo", "roll_ckpt_roll", "roll_ckpt_verl")


def module(name: str) -> ModuleType:
    return importlib.import_module(name)


def config() -> ModuleType:
    return module(CONFIG)


def config_error() -> type:
    return module("roll_ckpt").ConfigError


def roll_defaults() -> ModuleType:
    return module(ROLL_DEFAULTS)


def worker_strategy() -> tuple[str, ...]:
    return tuple(module(WORKER_STRATEGY).WORKER_STRATEGY)


def plugin_config_keys() -> dict:
    """``{key: ConfigKeyRecord}`` of every installed plugin (``roll_ckpt_config_keys``)."""
    return module(PLUGINS).get_plugins().config_keys()


def s3_retry_policy() -> type:
    """The ``file_system`` backend's retry policy: its fields are ``storage_options`` keys on ``s3://``."""
    return module(S3_RETRY).RetryPolicy


def cli_parser():
    return module(CLI).build_parser()
