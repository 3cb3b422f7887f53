"""The `envace` console script. Each command is one config dataclass (its flags) and one function."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable

from envace import config as cfgmod

# command -> (help, "module:ConfigClass", "module:function")
COMMANDS: dict[str, tuple[str, str, str]] = {
    "eval": ("evaluate a model on worlds, a task file or a benchmark", "envace.evaluation.runner:EvalConfig", "envace.evaluation.runner:run_eval"),
    "train": ("role-level GRPO with world rehearsal (and the baseline variants)", "envace.training.trainer:TrainConfig", "envace.training.trainer:run_train"),
    "sft": ("warm-start SFT on trajectories executed in the real world", "envace.training.sft:SFTConfig", "envace.training.sft:run_sft"),
    "demo": ("the whole method on CPU: evaluate, warm-start, train with rehearsal, evaluate, report", "envace.demo:DemoConfig", "envace.demo:run_demo"),
    "tasks": ("write built-in tasks to a JSONL task file", "envace.envs.export:ExportConfig", "envace.envs.export:export_tasks"),
    "serve": ("serve a model as an OpenAI-compatible HTTP server", "envace.backends.server:ServeConfig", "envace.backends.server:serve_command"),
}


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input: reported as one clear line, not a traceback. Imported here,
    when an error is being matched, so start-up stays light; a renamed class fails loudly."""
    from envace.backends.models import ModelNotFoundError
    from envace.backends.openai_http import BackendUnreachableError
    from envace.envs.tasks import TaskFormatError
    from envace.registry import RegistryError
    from envace.transcript import TemplateError

    return (cfgmod.ConfigError, RegistryError, FileNotFoundError, ModelNotFoundError, BackendUnreachableError, TaskFormatError, TemplateError)


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """Flags are generated only for the chosen command, so start-up imports only what it needs."""
    parser = argparse.ArgumentParser(prog="envace", description="Train and run tool-using agents with world rehearsal.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, config_spec, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            cfgmod.add_arguments(p, _load(config_spec))
    return parser


def end_process_group() -> None:
    """Tear down the process group a distributed launch (torchrun, accelerate launch) made, once the
    command has finished: torch asks every process to, and a group left to interpreter exit keeps
    gloo's and NCCL's threads alive into finalization (a warning, or an abort of a finished run).
    Only after success: on an error the other processes may never reach this point."""
    dist = sys.modules.get("torch.distributed")  # a command that never imported torch made no group
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    _, config_spec, fn_spec = COMMANDS[args.command]
    try:
        cfg = cfgmod.from_namespace(_load(config_spec), args)
        run: Callable[[Any], Any] = _load(fn_spec)
        run(cfg)
        end_process_group()
    except _user_errors() as exc:
        print(f"envace {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"envace {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
