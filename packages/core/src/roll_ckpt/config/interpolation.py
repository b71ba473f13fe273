"""``${...}`` interpolation in config values, by OmegaConf, as ROLL's Hydra configs use it.

``${key}`` and ``${a.b}`` (other keys), ``${oc.env:VAR}`` / ``${oc.env:VAR,default}`` and
``${env:VAR}`` / ``${env:VAR,default}`` (the environment), and every resolver the process
has registered with OmegaConf. A lone reference keeps its type (``${max_steps}`` stays an
int). The top-level ``hydra`` section is Hydra's own (it refers to Hydra's resolvers, such
as ``${now:...}``): it is kept as written, never resolved.

Every failure is a :class:`~roll_ckpt.errors.ConfigError` naming the key whose value could
not be resolved.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Mapping

from ..errors import ConfigError

__all__ = ["interpolate", "key_path", "HYDRA_SECTION"]

HYDRA_SECTION = "hydra"
_REFERENCES = "a key of this config (${a.b}), ${oc.env:VAR}, ${oc.env:VAR,default}, ${env:VAR} or ${env:VAR,default}"
_ENV_MISSING = re.compile(r"Environment variable '(.*)' not found")


def key_path(where: str, key: Any) -> str:
    """``where.key``, the key quoted when it would not show (empty, blank or padded)."""
    name = str(key)
    if not name.strip() or name != name.strip():
        name = repr(key)
    return f"{where}.{name}" if where else name


def _register_env_resolver() -> None:
    """``${env:VAR}``: the same resolver as OmegaConf's ``oc.env``, registered once. A
    resolver named ``env`` that the process registered itself is left in place."""
    import omegaconf
    from omegaconf import OmegaConf
    from omegaconf.resolvers.oc import env

    if OmegaConf.has_resolver("env"):
        return
    # OmegaConf 2.4 renamed register_new_resolver (now deprecated) to register_resolver,
    # the name of 2.0's deprecated string-only API that 2.1-2.3 still carry: pick by version.
    version = tuple(int(n) for n in re.findall(r"\d+", omegaconf.__version__)[:2])
    register = OmegaConf.register_resolver if version >= (2, 4) else OmegaConf.register_new_resolver
    try:
        register("env", env)
    except ValueError:  # another thread registered it in between
        pass


def _error(where: str, raw: Any, exc: Exception) -> ConfigError:
    """The ConfigError for ``exc``, raised while resolving ``raw`` at ``where``."""
    from omegaconf.errors import GrammarParseError, InterpolationKeyError, UnsupportedInterpolationType

    first = (str(exc).splitlines() or [type(exc).__name__])[0]
    shown = raw if isinstance(raw, str) else None
    missing_env = _ENV_MISSING.search(first)
    if missing_env:
        return ConfigError(where, f"environment variable '{missing_env.group(1)}' is not set", shown,
                           "set it, or give a default: ${oc.env:VAR,default} or ${env:VAR,default}")
    if "Recursive interpolation" in first:
        return ConfigError(where, "interpolation refers to itself", shown)
    if isinstance(exc, InterpolationKeyError):
        return ConfigError(where, f"interpolation names no key ({first})", shown, _REFERENCES)
    if isinstance(exc, UnsupportedInterpolationType):
        return ConfigError(where, f"uses a resolver that is not registered ({first})", shown,
                           f"{_REFERENCES}; or register the resolver with OmegaConf (register_new_resolver, "
                           "register_resolver in OmegaConf 2.4) before load_config")
    if isinstance(exc, GrammarParseError):
        return ConfigError(where, f"is not a valid ${{...}} interpolation ({first})", shown,
                           "${key}, ${a.b}, ${oc.env:VAR}; write \\${ for a literal ${")
    return ConfigError(where, f"cannot be resolved ({first})", shown)


def _get(node: Any, k: Any, here: str) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return node[k]
    except OmegaConfBaseException as exc:
        raise _error(here, OmegaConf.to_container(node, resolve=False)[k], exc) from None


def _plain(node: Any, where: str) -> Any:
    """``node`` (an OmegaConf container or value) resolved into plain dicts and lists."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(node, DictConfig):
        return {k: _plain(_get(node, k, key_path(where, k)), key_path(where, k)) for k in node.keys()}
    if isinstance(node, ListConfig):
        return [_plain(_get(node, i, f"{where}[{i}]"), f"{where}[{i}]") for i in range(len(node))]
    return node


def interpolate(root: Mapping[str, Any]) -> dict[str, Any]:
    """``root`` with every ``${...}`` resolved (but the ``hydra`` section, kept as written)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import GrammarParseError, OmegaConfBaseException

    _register_env_resolver()
    try:
        # allow_objects: YAML dates and other plain values pass through as they are
        conf = OmegaConf.create(dict(root), flags={"allow_objects": True})
    except OmegaConfBaseException as exc:  # a key type OmegaConf does not take, a malformed ${...}
        where = str(getattr(exc, "full_key", None) or "<config>")
        if isinstance(exc, GrammarParseError):
            raise _error(where, None, exc) from None
        raise ConfigError(where, f"cannot be read as a config ({(str(exc).splitlines() or [''])[0]})") from None
    out = {}
    for k in conf.keys():
        if k == HYDRA_SECTION:
            out[k] = copy.deepcopy(root[k])
        else:
            out[k] = _plain(_get(conf, k, key_path("", k)), key_path("", k))
    return out
