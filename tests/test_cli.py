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
