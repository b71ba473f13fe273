"""Config files with a Hydra defaults list: composed by Hydra itself when the ``hydra``
extra (hydra-core) is installed, with Hydra's resolvers (``${now:...}``); refused with a
message saying what to do when it is not."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from roll_ckpt import ConfigError, load_config
from roll_ckpt.config.file import hydra_available, read_config_file

CONFIGS = Path(__file__).resolve().parent / "roll_configs"
NOW = CONFIGS / "hydra_now" / "run_with_now.yaml"

pytestmark = pytest.mark.timeout(60)


def test_defaults_list_is_composed_with_hydras_resolvers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert hydra_available()
    cfg = load_config(NOW)
    assert cfg.exp_name == f"rlvr-{time.strftime('%Y%m%d')}"            # ${now:%Y%m%d}
    assert cfg.checkpoint_config.output_dir == f"./output/checkpoints/{cfg.exp_name}"
    assert cfg.extra["envs"] == {"count": 4, "name": "frozen-lake"}     # from the defaults list
    assert "defaults" not in cfg.extra and "hydra" not in cfg.extra
    assert (cfg.save_steps, cfg.max_steps) == (5, 10)


def test_plain_file_is_read_as_yaml(tmp_path: Path) -> None:
    path = tmp_path / "plain.yaml"
    path.write_text("exp_name: x\nsave_steps: 3\n")
    assert read_config_file(path) == {"exp_name": "x", "save_steps": 3}


def test_without_the_extra_the_refusal_stays(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "hydra", None)                     # hydra-core not installed
    assert not hydra_available()
    with pytest.raises(ConfigError) as info:
        load_config(NOW)
    assert info.value.key == "defaults"
    assert "roll-ckpt-core[hydra]" in str(info.value) and "compose it with Hydra first" in str(info.value)


@pytest.mark.filterwarnings("ignore:In .broken.. Defaults list is missing")
def test_a_defaults_list_naming_a_missing_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("defaults:\n  - no_such_file\nexp_name: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "defaults" and "no_such_file" in str(info.value)


def test_a_mapping_with_a_defaults_list_is_still_refused() -> None:
    with pytest.raises(ConfigError) as info:                            # no files to compose from
        load_config({"defaults": ["x"], "exp_name": "y"})
    assert info.value.key == "defaults"
