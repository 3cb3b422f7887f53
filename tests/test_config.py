import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import yaml

from envace.config import ConfigError, add_arguments, build, field, from_namespace, to_dict

PRESETS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@dataclass
class Inner:
    depth: int = field(1, help="how deep it goes")
    style: Literal["x", "y"] = field("x", help="which style")
    secret: int = field(0, help="decided by the command")

    def validate(self):
        if self.depth < 1:
            raise ConfigError(f"depth must be >= 1, got {self.depth}")


def demo_inner():
    return Inner(depth=5)  # the command's own default, not Inner's


@dataclass
class Demo:
    name: str = field("x", help="a name")
    steps: int = field(3, help="steps")
    lr: float = field(0.1, help="lr")
    mode: Literal["a", "b"] = field("a", help="mode")
    flag: bool = field(False, help="flag")
    items: list[str] = field([], help="items")
    limit: int | None = field(None, help="limit")
    inner: Inner = field(default_factory=demo_inner, help="the inner settings", hidden={"secret": "the command sets it"})

    def validate(self):
        self.inner.validate()
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")


def parser():
    p = argparse.ArgumentParser()
    add_arguments(p, Demo)
    return p


def parse(argv):
    return from_namespace(Demo, parser().parse_args(argv))


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_flag_overrides_yaml_which_overrides_the_default(tmp_path):
    path = write(tmp_path, "steps: 7\nlr: 1\ndepth: 2\n")
    cfg = parse(["--config", path, "--steps", "9", "--flag", "--items", "p", "q"])
    assert (cfg.steps, cfg.lr, cfg.flag, cfg.items, cfg.limit, cfg.inner.depth) == (9, 1.0, True, ["p", "q"], None, 2)
    assert parse(["--config", path, "--depth", "4"]).inner.depth == 4  # a nested option's flag beats the file too
    assert parse([]).inner.depth == 5  # the command's default_factory, not Inner's own default


def test_nested_and_flat_yaml_load_the_same_config(tmp_path):
    flat = parse(["--config", write(tmp_path, "steps: 2\ndepth: 3\nstyle: y\n")])
    nested = parse(["--config", write(tmp_path, "steps: 2\ninner: {depth: 3, style: y}\n")])
    assert flat == nested and nested.inner == Inner(depth=3, style="y")


def test_nested_flags_are_flat_with_their_help_and_command_default():
    text = parser().format_help()
    assert "--depth DEPTH" in text and "--style {x,y}" in text and "--inner" not in text
    assert "how deep it goes (default: 5)" in " ".join(text.split())
    assert "inner options" in text and "the inner settings" in text


def test_steps_zero_is_rejected_naming_steps():
    with pytest.raises(ConfigError, match="steps must be >= 1, got 0"):
        parse(["--steps", "0"])


def test_nested_validate_runs_as_part_of_the_parent():
    with pytest.raises(ConfigError, match="depth must be >= 1, got 0"):
        build(Demo, {"inner": {"depth": 0}})


@pytest.mark.parametrize("values,match", [
    ({"stepz": 1}, "unknown option stepz for Demo"),
    ({"inner": {"stepz": 1}}, "unknown option inner.stepz for Demo; known in inner: depth, style"),
    ({"inner": {"steps": 1}}, "unknown option inner.steps"),  # a parent option is not an inner one
    ({"secret": 1}, "secret is not an option of Demo: the command sets it"),
    ({"inner": {"secret": 1}}, "inner.secret is not an option of Demo: the command sets it"),
    ({"depth": 2, "inner": {"depth": 3}}, "depth is given twice"),
    ({"inner": 3}, "inner must be a mapping"),
    ({"mode": "c"}, "mode='c' is not one of"),
    ({"style": "z"}, "style='z' is not one of"),
    ({"steps": "many"}, "steps must be int"),
])
def test_bad_options_are_rejected_by_name(values, match):
    with pytest.raises(ConfigError, match=match):
        build(Demo, values)


def test_hidden_option_has_no_flag():
    with pytest.raises(SystemExit):
        parser().parse_args(["--secret", "1"])


def test_missing_config_file_fails_clearly(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse(["--config", str(tmp_path / "missing.yaml")])


def test_saved_options_load_back_to_the_same_config():
    cfg = build(Demo, {"steps": 4, "depth": 2, "items": ["a"]})
    saved = to_dict(cfg)
    assert "secret" not in saved and saved["depth"] == 2  # flat, the names of the flags
    assert build(Demo, saved) == cfg


def test_a_field_clashing_with_a_nested_one_is_a_definition_error():
    @dataclass
    class Clash:
        depth: int = field(1)
        inner: Inner = field(default_factory=Inner)

    with pytest.raises(TypeError, match="depth"):
        build(Clash, {})


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_presets_load_every_value_into_the_train_config(preset):
    from envace.training.trainer import TrainConfig

    values = yaml.safe_load(preset.read_text())
    loaded = to_dict(build(TrainConfig, values))
    assert {k: loaded[k] for k in values} == values  # no preset value is dropped or misrouted


def test_the_two_node_launch_config_is_what_accelerate_reads_as_16_gpu_processes():
    from accelerate.commands.config.config_args import load_config_from_file

    launch = load_config_from_file(str(Path(__file__).parent.parent / "configs" / "accelerate" / "2x8-gpus.yaml"))
    assert (launch.num_machines, launch.num_processes, launch.distributed_type.value) == (2, 16, "MULTI_GPU")


def test_train_and_eval_keep_their_own_rollout_defaults():
    from envace.evaluation.runner import EvalConfig
    from envace.training.trainer import TrainConfig

    train, evaluation = build(TrainConfig, {}).rollout, build(EvalConfig, {}).rollout
    assert (train.max_turns, train.max_turn_tokens, train.max_rehearse_tokens, train.max_total_tokens, train.temperature, train.top_p) == (6, 128, 96, 2048, 1.0, 1.0)
    assert (evaluation.temperature, evaluation.top_p, evaluation.max_active) == (0.6, 0.95, 64)


def test_train_rejects_the_mode_the_variant_decides():
    from envace.training.trainer import TrainConfig

    with pytest.raises(ConfigError, match="mode is not an option of TrainConfig: the variant decides"):
        build(TrainConfig, {"mode": "real"})


def test_a_run_saved_before_nesting_still_resumes(tmp_path):
    """A config.yaml written before the rollout settings were nested is flat and lacks the
    options train could not set then; --resume compares it without a spurious difference."""
    from envace.training.setup import check_resume
    from envace.training.trainer import TrainConfig

    cfg = build(TrainConfig, {"output_dir": str(tmp_path), "resume": True, "max_turns": 3})
    (tmp_path / "checkpoints" / "step-00000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000001" / "state.json").write_text("{}")
    old = {k: v for k, v in to_dict(cfg).items() if k not in ("accept_fenced_json", "grounding", "max_active")}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert check_resume(tmp_path, cfg, resume=True) is not None
    changed = build(TrainConfig, {"output_dir": str(tmp_path), "resume": True, "max_turns": 4})
    with pytest.raises(ConfigError, match="options differ.*max_turns"):
        check_resume(tmp_path, changed, resume=True)


def test_a_weighted_reward_and_its_judge_load_from_flags_and_yaml_and_save_back(tmp_path):
    """`judge:0.7,reference:0.3` is one string to argparse and YAML alike (no flag splitting,
    no YAML mapping or sexagesimal number), so a saved run loads back to the same config."""
    from envace.training.trainer import TrainConfig

    p = argparse.ArgumentParser()
    add_arguments(p, TrainConfig)
    flags = from_namespace(TrainConfig, p.parse_args(["--reward", "judge:0.7,reference:0.3", "--judge", "http://127.0.0.1:9/v1"]))
    from_yaml = from_namespace(TrainConfig, p.parse_args(["--config", write(tmp_path, "reward: judge:0.7,reference:0.3\njudge: http://127.0.0.1:9/v1\n")]))
    assert flags == from_yaml and (flags.reward, flags.judge) == ("judge:0.7,reference:0.3", "http://127.0.0.1:9/v1")
    saved = tmp_path / "saved.yaml"
    saved.write_text(yaml.safe_dump(to_dict(flags)))
    assert build(TrainConfig, yaml.safe_load(saved.read_text())) == flags
