"""The console script: bad input is one clear line on stderr (exit 2), never a traceback."""

from envace.cli import main


def test_unreachable_server_fails_clearly(capsys):
    code = main(["eval", "--model", "http://127.0.0.1:9/v1", "--no-progress", "--limit", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "127.0.0.1:9" in err and "Traceback" not in err


def test_unknown_model_and_world_fail_before_work(capsys):
    assert main(["eval", "--model", "/no/such/model"]) == 2
    assert main(["eval", "--worlds", "atlantis"]) == 2
    err = capsys.readouterr().err
    assert "/no/such/model" in err and "atlantis" in err


def test_bad_task_file_names_the_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"world": "bank", "messages": [{"role": "user", "content": "hi"}]}\n{"world": "bank"\n')
    assert main(["eval", "--tasks", str(path)]) == 2
    assert "t.jsonl:2" in capsys.readouterr().err


def test_help_lists_commands(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("eval", "train", "sft", "demo", "tasks", "serve"):
        assert command in out


def test_user_errors_map_each_named_class():
    from envace.backends.models import ModelNotFoundError
    from envace.backends.openai_http import BackendUnreachableError
    from envace.cli import _user_errors
    from envace.config import ConfigError
    from envace.envs.tasks import TaskFormatError
    from envace.registry import RegistryError
    from envace.transcript import TemplateError

    mapped = _user_errors()
    for cls in (ConfigError, RegistryError, ModelNotFoundError, BackendUnreachableError, TaskFormatError, TemplateError):
        assert cls in mapped, cls.__name__


def no_model_may_load(monkeypatch):
    """Make any model load fail loudly (an AssertionError is no user error: it would escape main)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr("envace.training.trainer.load_trainable", refuse)


def test_train_rejects_a_bad_option_before_any_model_loads(monkeypatch, capsys, tmp_path):
    no_model_may_load(monkeypatch)
    for argv, message in ((["--dual-clip", "0.5"], "dual_clip must be > 1"),
                          (["--reward", "judge"], "has a judge component: give --judge MODEL"),
                          (["--top-p", "0.9"], "full vocabulary (top_p 1")):
        assert main(["train", "--tiny", "--output-dir", str(tmp_path / "run"), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # no work started


def test_train_mode_in_yaml_says_the_variant_decides(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  mode: simulator\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "the variant decides" in capsys.readouterr().err


def test_eval_and_train_help_list_the_rollout_flags_with_their_defaults(capsys):
    import pytest

    for command, default in (("eval", "(default: 0.6)"), ("train", "(default: 1.0)")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "rollout options" in out and "--max-turns MAX_TURNS" in out and "--rehearse-layout {transcript,isolated}" in out
        assert f"sampling temperature (0 = greedy) {default}" in out
        assert ("--mode {real,rehearse,simulator,recorded}" in out) == (command == "eval")  # train's variant decides the mode


def test_a_finished_command_tears_down_the_process_group_a_distributed_launch_made(monkeypatch, tmp_path):
    """Under torchrun each process joins a group; the command destroys it once done, so gloo's and
    NCCL's threads do not outlive it into interpreter exit. A failing command leaves it alone (the
    other processes may never arrive)."""
    import torch.distributed as dist

    def joins_a_group(cfg, fail=False):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store-{fail}", rank=0, world_size=1)
        if fail:
            raise FileNotFoundError("no such task file")

    monkeypatch.setattr("envace.envs.export.export_tasks", joins_a_group)
    assert main(["tasks", "--output", str(tmp_path / "t.jsonl")]) == 0
    assert not dist.is_initialized()
    monkeypatch.setattr("envace.envs.export.export_tasks", lambda cfg: joins_a_group(cfg, fail=True))
    try:
        assert main(["tasks", "--output", str(tmp_path / "t.jsonl")]) == 2
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
