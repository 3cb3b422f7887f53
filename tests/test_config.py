import argparse
from dataclasses import dataclass
from typing import Literal

import pytest

from envace.config import ConfigError, add_arguments, build, field, from_namespace


@dataclass
class Demo:
    name: str = field("x", help="a name")
    steps: int = field(3, help="steps")
    lr: float = field(0.1, help="lr")
    mode: Literal["a", "b"] = field("a", help="mode")
    flag: bool = field(False, help="flag")
    items: list[str] = field([], help="items")
    limit: int | None = field(None, help="limit")

    def validate(self):
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")


def parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p, Demo)
    return from_namespace(Demo, p.parse_args(argv))


def test_cli_overrides_yaml_overrides_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\nlr: 1\nmode: b\n")
    cfg = parse(["--config", str(path), "--steps", "9", "--flag", "--items", "p", "q"])
    assert (cfg.steps, cfg.lr, cfg.mode, cfg.flag, cfg.items, cfg.limit) == (9, 1.0, "b", True, ["p", "q"], None)


def test_validation_and_unknown_keys_fail_clearly(tmp_path):
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        parse(["--steps", "0"])
    with pytest.raises(ConfigError, match="unknown option.*stepz"):
        build(Demo, {"stepz": 1})
    with pytest.raises(ConfigError, match="mode='c' is not one of"):
        build(Demo, {"mode": "c"})
    with pytest.raises(ConfigError, match="steps must be int"):
        build(Demo, {"steps": "many"})
    with pytest.raises(ConfigError, match="does not exist"):
        parse(["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("preset", sorted(__import__("pathlib").Path(__file__).parent.parent.glob("configs/*.yaml")), ids=lambda p: p.name)
def test_presets_are_valid_train_configs(preset):
    import yaml

    from envace.training.trainer import TrainConfig

    values = yaml.safe_load(preset.read_text()) | {"model": "default"}
    cfg = build(TrainConfig, values)
    assert cfg.steps >= 1
