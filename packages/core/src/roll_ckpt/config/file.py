"""Reading a config file: plain YAML, or a Hydra ``defaults:`` list composed by Hydra itself.

35 of ROLL's example configs begin with a ``defaults:`` list (other files merged in) and
ROLL composes them with Hydra (``@hydra.main``). With the optional extra
``roll-ckpt-core[hydra]`` (hydra-core) installed, :func:`read_config_file` does the same:
``hydra.compose`` over the file's folder, with Hydra's resolvers registered (``${now:...}``)
and the ``hydra`` section left out, as Hydra hands an application its config. Without it,
such a file is refused with a message saying how to compose it (install the extra, or pass
the DictConfig Hydra gives the application).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["read_yaml", "read_config_file", "compose_with_hydra", "hydra_available"]

HYDRA_HINT = ("install the extra that composes it (pip install 'roll-ckpt-core[hydra]'), or compose it with Hydra "
              "first: pass the DictConfig your @hydra.main function gets (or hydra.compose(...)) to load_config, "
              "or write it out with `python your_app.py --cfg job > composed.yaml`")


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping a YAML config file holds, or a ConfigError saying why it cannot be read."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("<file>", f"config file {path} does not exist", None,
                          "a readable YAML file; see examples/") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("<file>", f"config file {path} cannot be read: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"config file {path} is not valid YAML: {exc}".replace("\n", " ")) from None
    except RecursionError:
        raise ConfigError("<file>", f"config file {path} is nested too deeply") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("<file>", f"config file {path} must hold a mapping at top level",
                          type(data).__name__)
    return data


def hydra_available() -> bool:
    try:
        import hydra  # noqa: F401
    except ImportError:
        return False
    return True


def compose_with_hydra(path: Path) -> dict[str, Any]:
    """``path`` composed by Hydra (its ``defaults:`` list merged, Hydra's resolvers
    registered), as a mapping whose ``${...}`` are not resolved yet (``load_config``
    resolves them, naming the key of a value that cannot be)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import hydra.core.utils  # noqa: F401  (registers ${now:...})

    folder = str(path.resolve().parent)
    was = GlobalHydra.instance().is_initialized()
    if was:  # inside an application Hydra already runs: compose with a fresh instance, then leave it as it was
        raise ConfigError("defaults", f"{path} has a Hydra defaults list, and Hydra is already initialized in this "
                          "process", None, "pass the DictConfig Hydra composed (cfg of @hydra.main) to load_config")
    try:
        with initialize_config_dir(config_dir=folder, version_base=None):
            composed = compose(config_name=path.stem)
    except (HydraException, OmegaConfBaseException, ValueError, TypeError, KeyError, OSError, AssertionError) as exc:
        # Hydra reports a malformed defaults list with plain ValueErrors as well as its own, and
        # some entries (an empty group name, `- "": x`) only with an assert of its dataclasses
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, AssertionError):
            first = f"an entry it cannot read, such as an empty group or option name ({first})"
        raise ConfigError("defaults", f"Hydra cannot compose {path}: {first}", None,
                          "fix the defaults list (each entry names a file relative to the config's folder)") from None
    return OmegaConf.to_container(composed, resolve=False)  # type: ignore[return-value]


def read_config_file(path: Path) -> dict[str, Any]:
    """The config a file holds: read as YAML; a Hydra ``defaults:`` list composed by Hydra
    (with the ``hydra`` extra), or refused with what to do (without it)."""
    data = read_yaml(path)
    if not isinstance(data.get("defaults"), list):
        return data
    if not hydra_available():
        raise ConfigError("defaults", "is a Hydra defaults list: roll-ckpt reads one composed config, not the "
                          "files it lists", None, HYDRA_HINT)
    return compose_with_hydra(path)
