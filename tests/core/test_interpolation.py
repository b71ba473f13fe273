"""``${...}`` interpolation through OmegaConf, as ROLL's Hydra configs write it; every
failure a ConfigError naming the key."""

from __future__ import annotations

import datetime

import pytest
from omegaconf import OmegaConf

from roll_ckpt import ConfigError, load_config
from roll_ckpt.config.interpolation import interpolate


def test_roll_forms_resolve_and_lone_references_keep_their_type(monkeypatch) -> None:
    monkeypatch.setenv("RC_TEST_ROOT", "/mnt/ckpt")
    monkeypatch.delenv("RC_TEST_UNSET", raising=False)
    out = interpolate({
        "response_length": 1024,
        "actor_infer": {"generating_args": {"max_new_tokens": "${response_length}", "top_p": 0.99}},
        "sequence_length": "${actor_infer.generating_args.max_new_tokens}",
        "oc_env": "${oc.env:RC_TEST_ROOT}/x",
        "oc_env_default": "${oc.env:RC_TEST_UNSET,/tmp/default}",
        "oc_env_url_default": "${oc.env:RC_TEST_UNSET,http://127.0.0.1:9000}",
        "env": "${env:RC_TEST_ROOT}",
        "env_default_number": "${env:RC_TEST_UNSET,8}",
        "relative": {"a": 3, "b": "${.a}"},
        "decoded": "${oc.decode:'[1, 2]'}",
        "when": datetime.date(2025, 6, 1),               # a YAML date: passed through as it is
    })
    assert out["actor_infer"]["generating_args"]["max_new_tokens"] == 1024
    assert out["sequence_length"] == 1024 and isinstance(out["sequence_length"], int)
    assert out["oc_env"] == "/mnt/ckpt/x"
    assert out["oc_env_default"] == "/tmp/default"
    assert out["oc_env_url_default"] == "http://127.0.0.1:9000"
    assert out["env"] == "/mnt/ckpt"
    assert out["env_default_number"] == "8"                # environment values are strings, defaults too
    assert out["relative"] == {"a": 3, "b": 3}
    assert out["decoded"] == [1, 2]
    assert out["when"] == datetime.date(2025, 6, 1)
    assert type(out) is dict and type(out["actor_infer"]) is dict  # plain containers, no OmegaConf nodes


def test_the_hydra_section_is_kept_as_written() -> None:
    hydra = {"run": {"dir": "outputs/${now:%Y-%m-%d}/${hydra:job.name}"}, "output_subdir": None}
    out = interpolate({"hydra": hydra, "exp_name": "e", "x": "${exp_name}"})
    assert out["hydra"] == hydra and out["hydra"] is not hydra
    assert out["x"] == "e"


@pytest.mark.parametrize("raw,key,fragments", [
    ({"a": {"b": "${oc.env:RC_TEST_UNSET}"}}, "a.b", ["RC_TEST_UNSET", "is not set", "${oc.env:VAR,default}"]),
    ({"a": ["x", "${env:RC_TEST_UNSET}"]}, "a[1]", ["RC_TEST_UNSET", "${env:VAR,default}"]),
    ({"a": {"b": "${nope.deeper}"}}, "a.b", ["names no key", "${nope.deeper}"]),
    # not `now`: importing Hydra (another test does) registers that one for the whole process
    ({"a": "${rc_no_such_resolver:%Y}"}, "a", ["resolver that is not registered", "rc_no_such_resolver",
                                              "register_new_resolver"]),
    ({"a": "x ${ y"}, "a", ["not a valid ${...} interpolation", "\\${"]),
    ({"a": {"b": "${a.c}", "c": "${a.b}"}}, "a.b", ["refers to itself"]),
    ({"a": {"": "${nope}"}}, "a.''", ["names no key"]),
    ({"m": "${n.x}", "n": 3}, "m", ["cannot be resolved", "not a container"]),
])
def test_failures_name_the_key(monkeypatch, raw, key, fragments) -> None:
    monkeypatch.delenv("RC_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert info.value.key == key
    msg = str(info.value)
    assert msg.startswith(f"config key '{key}'") and "\n" not in msg
    for fragment in fragments:
        assert fragment in msg


def test_a_key_omegaconf_cannot_hold_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"rewards": {None: 1}})
    assert info.value.key == "rewards" and "cannot be read as a config" in str(info.value)


@pytest.mark.filterwarnings("ignore:register_new_resolver:UserWarning")  # deprecated in OmegaConf 2.4 only
def test_env_resolver_registered_by_the_process_is_kept(monkeypatch) -> None:
    """A process (or Hydra app) that registered its own ``env`` resolver keeps it."""
    interpolate({})                                       # ours, registered once
    monkeypatch.setenv("RC_TEST_ROOT", "/from/env")
    assert interpolate({"x": "${env:RC_TEST_ROOT}"}) == {"x": "/from/env"}
    OmegaConf.clear_resolver("env")
    try:
        OmegaConf.register_new_resolver("env", lambda name: f"mine:{name}")
        assert interpolate({"x": "${env:RC_TEST_ROOT}"}) == {"x": "mine:RC_TEST_ROOT"}
    finally:
        OmegaConf.clear_resolver("env")
    assert interpolate({"x": "${env:RC_TEST_ROOT}"}) == {"x": "/from/env"}  # ours again
