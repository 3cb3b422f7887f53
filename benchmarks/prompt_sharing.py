"""The first generate call of an evaluation and of a GRPO rollout round, with prompts encoded per
session or shared (`HFGenerator(share_prompts=...)`), side by side in one process.

    python benchmarks/prompt_sharing.py --model runs/demo/sft/final

"evaluation": the demo's 40 test tasks (8 per world), one session each, greedy: the tasks of one
world share their system prompt and tool list. "grpo": 3 training tasks x K=4, two of them from
one world, sampled at the demo's temperature 0.5 from the same seed: each task's K sessions share
its whole prompt, the two tasks of one world also their system prompt. Each call generates one
ACT turn's worth of tokens (96). Reports the fastest of --repeats calls, the prefill tokens, and
whether the outputs are token for token the same either way. Writes
benchmarks/results/prompt_sharing.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from envace.backends import HFGenerator, load_model
from envace.backends.base import SamplingParams
from envace.envs.environment import WorldEnvironment
from envace.envs.tasks import builtin_tasks
from envace.transcript import Transcript


def prompts_of(tasks: list, tokenizer: Any) -> list[list[int]]:
    transcript, env = Transcript(tokenizer), WorldEnvironment()
    return [transcript.prompt(t.messages, *env.describe(t)).token_ids for t in tasks]


def first_call(model: Any, tokenizer: Any, prompts: list[list[int]], params: SamplingParams, share: bool, repeats: int) -> dict[str, Any]:
    best, outputs, prefill = float("inf"), None, 0
    for _ in range(repeats):
        gen = HFGenerator(model, tokenizer, seed=0, share_prompts=share)
        sessions = gen.open(len(prompts))
        start = time.perf_counter()
        outs = gen.generate(sessions, [list(p) for p in prompts], params)
        best = min(best, time.perf_counter() - start)
        outputs, prefill = [o.token_ids for o in outs], gen.stats.prefill_tokens
        gen.close(sessions)
    return {"seconds": best, "prefill_tokens": prefill, "generated_tokens": sum(map(len, outputs)), "outputs": outputs}


def compare(model: Any, tokenizer: Any, prompts: list[list[int]], params: SamplingParams, repeats: int) -> dict[str, Any]:
    per_session, shared = (first_call(model, tokenizer, prompts, params, share, repeats) for share in (False, True))
    same = per_session.pop("outputs") == shared.pop("outputs")
    result = {"sessions": len(prompts), "prompt_tokens": sum(map(len, prompts)), "per_session": per_session, "shared": shared,
              "speedup": per_session["seconds"] / shared["seconds"], "identical_outputs": same}
    print(f"{len(prompts)} sessions: per session {per_session['seconds']:.1f} s, {per_session['prefill_tokens']} prefill tokens; "
          f"shared {shared['seconds']:.1f} s, {shared['prefill_tokens']}; {result['speedup']:.2f}x, identical outputs: {same}", flush=True)
    return result


def grpo_tasks(k: int) -> list:
    """3 training tasks, two of one world, each K times (the demo's 3 tasks x K=4)."""
    bank = builtin_tasks("train", 2, worlds=["bank"], difficulty=1)
    shop = builtin_tasks("train", 1, worlds=["shop"], difficulty=1)
    return [t for t in bank + shop for _ in range(k)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default="benchmarks/results/prompt_sharing.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    stop = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    evaluation = prompts_of(builtin_tasks("test", 8, difficulty=1), tokenizer)
    grpo = prompts_of(grpo_tasks(4), tokenizer)
    summary = {"model": args.model, "threads": args.threads, "repeats": args.repeats,
               "evaluation": compare(model, tokenizer, evaluation, SamplingParams(temperature=0.0, **stop), args.repeats),
               "grpo": compare(model, tokenizer, grpo, SamplingParams(temperature=0.5, **stop), args.repeats)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
