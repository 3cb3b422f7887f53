"""How fast a GRPO step runs on this machine, against the machine's own limits and llama.cpp,
everything measured side by side in ONE run (so the ratios hold on a noisy, shared machine).

    python benchmarks/step_speed.py                       # ~15 min on 2 cores; writes the JSON and the table
    python benchmarks/step_speed.py --write-docs          # also replaces the table in docs/performance.md
    python benchmarks/step_speed.py --skip step           # leave out the GRPO-step comparison

Sections (each one a function below; figures are for the default model, SmolLM2-135M):
  machine   fp32 and bf16 matmul GFLOP/s measured now (2048^3; bf16 at 512^3 on a CPU that
            emulates it, where 2048^3 takes a minute), and from them the model's matmul-bound
            token rate: GFLOP/s / (2 x matmul parameters) tokens/s;
  decode    batch-1, 8 and 32 decode tok/s after a real tool prompt: envace's HF backend through
            transformers' forward (the reference), through the lean path in fp32 and in bf16
            (envace/backends/lean.py; the row marked "default here" is --sampler-dtype auto on this
            machine) and with int8 or int4 weight copies for small batches (--sampler-dtype int8 /
            int4, over bf16 or fp32 as this CPU gets it), and llama.cpp on the model's own Q4_1
            GGUF (what a user would otherwise run);
  prefill   tokens/s encoding 8 different prompts, transformers' forward and the default lean path;
  update    forward+backward of the PPO loss on K=4 rollouts of 2 tasks: fp32 vs bf16 autocast
            (bf16 only where the CPU has it natively: emulated, it would take hours), separate
            rows vs shared-prefix packing; forwarded tokens and effective GFLOP/s;
  step      `envace train`'s step with today's settings vs the old ones (transformers' forward,
            fp32, no packing, each rollout's prompt encoded on its own) and the previous ones
            (transformers' forward sampling, packed update), same seeds, same tasks; precisions
            and sampler dtypes as auto picks them here; speed-ups plain and scaled to the old
            step's work (other samplers draw other tokens);
  greedy    greedy real-mode actions on 10 fixed tasks: each lean engine against transformers'
            forward (identical, or the logprob mismatch reported).
Writes benchmarks/results/step_speed.json and prints the Markdown table of docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from envace.backends import HFGenerator, load_model
from envace.backends.base import SamplingParams
from envace.backends import lean
from envace.backends.lean import decode_settings
from envace.backends.models import native_bf16

RESULTS = Path("benchmarks/results/step_speed.json")
DOCS = Path("docs/performance.md")
BEGIN, END = "<!-- step_speed:begin -->", "<!-- step_speed:end -->"
SECTIONS = ("machine", "decode", "prefill", "update", "step")


def best_of(n: int, fn: Callable[[], Any]) -> float:
    """The fastest of n timed calls (the least disturbed by other jobs)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_params(model: Any) -> int:
    """Parameters that take part in a matmul per token (every Linear, the LM head included;
    not the embedding lookup)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def machine(model: Any) -> dict[str, float]:
    out = {"threads": torch.get_num_threads(), "matmul_params": matmul_params(model), "native_bf16": native_bf16()}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        n = 2048 if dtype == torch.float32 or native_bf16() else 512
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[f"matmul_gflops_{name}"] = 2 * n**3 / best_of(4, lambda: a @ b) / 1e9
        out[f"token_limit_{name}"] = out[f"matmul_gflops_{name}"] * 1e9 / (2 * out["matmul_params"])
    return out


def tool_prompt(tokenizer: Any) -> list[int]:
    """A real rollout prompt: a bank task's system prompt, tool documentation and user message."""
    from envace.envs.environment import WorldEnvironment
    from envace.envs.tasks import builtin_tasks
    from envace.transcript import Transcript

    task = builtin_tasks("test", 1, worlds=["bank"], difficulty=2)[0]
    description, tools = WorldEnvironment().describe(task)
    return Transcript(tokenizer).prompt(task.messages, description, tools).token_ids


def probe_setup(sampler_dtype: str) -> tuple[HFGenerator, list[int]]:
    """The decode probes' setup (decode_compile.py, lean_ab.py): 2 threads, the default model's
    generator in `sampler_dtype` (`--sampler-dtype`), and the tool prompt."""
    torch.set_num_threads(2)
    model, tokenizer = load_model("default", dtype=torch.float32)
    return HFGenerator(model, tokenizer, **decode_settings(sampler_dtype, model)), tool_prompt(tokenizer)


def decode_rate(generator: Any, prompt: list[int], batch: int, new_tokens: int) -> dict[str, float]:
    """`batch` sessions fed `prompt` and one token generated (the prefill, timed), then
    `new_tokens` more generated with nothing new fed: pure decode over the cached prompt (timed).
    Stop conditions are off, so every session decodes all of them."""
    sessions = generator.open(batch)
    try:
        start = time.perf_counter()
        generator.generate(sessions, [list(prompt)] * batch, SamplingParams(max_new_tokens=1, temperature=0.0))
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        generator.generate(sessions, [[] for _ in range(batch)], SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
        decode_s = time.perf_counter() - start
    finally:
        generator.close(sessions)
    return {"tok_per_s": batch * new_tokens / decode_s, "prefill_s": prefill_s, "decode_s": decode_s}


REFERENCE = "envace HF, transformers' forward, fp32 (before)"


def hf_engines(model: Any) -> dict[str, dict[str, Any]]:
    """The HF backend's engines (HFGenerator keywords), the reference first; " (default here)"
    marks what --sampler-dtype auto runs on this machine."""
    auto = decode_settings("auto", model)
    engines = {
        REFERENCE: dict(lean=False),
        "envace HF, lean path, fp32": dict(dtype=None, quant=None),
        "envace HF, lean path, bf16": dict(dtype=torch.bfloat16, quant=None),
    }
    for quant, rows in lean.QUANT_MAX_ROWS.items():
        kw = decode_settings(quant, model)
        engines[f"envace HF, lean path, {quant} weights for <= {rows} rows over {'bf16' if kw['dtype'] == torch.bfloat16 else 'fp32'}"] = kw
    return {name + (" (default here)" if kw == auto else ""): kw for name, kw in engines.items()}


def default_engine(model: Any) -> str:
    return next(name for name in hf_engines(model) if name.endswith("(default here)"))


def decode(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    prompt = tool_prompt(tokenizer)
    engines: dict[str, Callable[[], Any]] = {name: (lambda kw=kw: HFGenerator(model, tokenizer, **kw)) for name, kw in hf_engines(model).items()}
    if lean.transposed_gemm_is_faster():
        engines["envace HF, lean path, fp32, F.linear for every matmul (no transposed few-row matmuls)"] = lambda: linear_only(model, tokenizer)
    if llamacpp_available():
        from envace.backends.llamacpp import LlamaCppGenerator

        engines["llama.cpp on the shipped Q4_1 GGUF"] = lambda: LlamaCppGenerator(
            model, tokenizer, args.model, max_sessions=32, n_ctx_per_session=len(prompt) + args.new_tokens + 8, serve_template=True)
    else:
        print("llama.cpp rows skipped: pip install -e '.[llamacpp]'")
    out: dict[str, Any] = {"prompt_tokens": len(prompt), "new_tokens": args.new_tokens}
    for name, make in engines.items():
        generator = make()
        # llama.cpp prefills every session's prompt (its slots share nothing): batch 32 would
        # spend minutes there, so its engines run batch 1 and 8; the HF backend all three.
        batches = (1, 4, 8, 32) if isinstance(generator, HFGenerator) else (1, 4, 8)
        out[name] = {f"batch{b}": decode_rate(generator, prompt, b, args.new_tokens) for b in batches}
        print(f"decode {name}: " + ", ".join(f"{k} {v['tok_per_s']:.1f} tok/s" for k, v in out[name].items()), flush=True)
        getattr(generator, "shutdown", lambda: None)()
    return out


def linear_only(model: Any, tokenizer: Any) -> HFGenerator:
    """The lean fp32 path as on a CPU where `lean.transposed_gemm_is_faster` is False: its packed
    copy, built here with the rule off, keeps F.linear for every matmul."""
    generator = HFGenerator(model, tokenizer, dtype=None, quant=None)
    rule = lean.transposed_gemm_is_faster
    lean.transposed_gemm_is_faster = lambda: False
    try:
        generator.lean.current()
    finally:
        lean.transposed_gemm_is_faster = rule
    return generator


def prefill(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    base = tool_prompt(tokenizer)
    prompts = [[tokenizer.eos_token_id] * i + base for i in range(8)]  # different prompts: nothing shared
    out: dict[str, Any] = {"tokens": sum(map(len, prompts))}
    engines = hf_engines(model)
    for name in (REFERENCE, default_engine(model)):
        generator = HFGenerator(model, tokenizer, **engines[name])

        def call() -> None:
            sessions = generator.open(len(prompts))
            generator.generate(sessions, prompts, SamplingParams(max_new_tokens=1, temperature=0.0))
            generator.close(sessions)

        out[name] = {"tok_per_s": out["tokens"] / best_of(2, call)}
        print(f"prefill {name}: {out[name]['tok_per_s']:.0f} tok/s", flush=True)
    return out


def update_rows(tokenizer: Any, k: int) -> list[Any]:
    """K copies of the reference trajectories of two difficulty-1 tasks (bank, shop) as one GRPO
    step would train them: ACT and the rehearsed tool responses trained, one group per task."""
    from envace.algorithms.advantages import TrajectoryAdvantages
    from envace.algorithms.losses import build_rows
    from envace.envs.environment import WorldEnvironment
    from envace.envs.tasks import builtin_tasks
    from envace.training.sft import reference_trajectories
    from envace.types import Role

    tasks = builtin_tasks("train", 1, worlds=["bank", "shop"], difficulty=1)
    trajs, _, _ = reference_trajectories(tasks, tokenizer, WorldEnvironment(), 4096)
    for traj in trajs:
        for turn in traj.turns:
            if turn.role == Role.ENV:
                turn.role, turn.logprobs = Role.REHEARSE, [-1.0] * len(turn.token_ids)
    group = [t for t in trajs for _ in range(k)]
    advantages = [TrajectoryAdvantages(outputs={}, tokens=[0.5 if i % 2 else -0.5] * len(t.token_ids), side_rows=[]) for i, t in enumerate(group)]
    return build_rows(group, advantages, (Role.ACT, Role.REHEARSE), group_sizes=[k] * len(trajs))


def update(model: Any, tokenizer: Any, limits: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    from envace.algorithms.losses import forwarded_tokens, pack_shared_prefixes, ppo_loss, sequence_logprobs
    from envace.training.setup import backward_micro_batches, make_accelerator

    rows = update_rows(tokenizer, args.k)
    trained = sum(sum(r.loss_mask) for r in rows)
    out: dict[str, Any] = {"rows": len(rows), "trained_tokens": trained}
    model.train()
    for precision in ("fp32", "bf16") if native_bf16() else ("fp32",):
        accelerator = make_accelerator(precision)
        for share in (False, True):
            forwarded = forwarded_tokens(pack_shared_prefixes(rows) if share else rows)

            def loss_fn(batch: Any) -> Any:
                logprobs, _ = sequence_logprobs(model, batch, trained_only=True)
                return ppo_loss(logprobs, batch.sampler_logprobs, batch.advantages, batch.loss_mask, num_tokens=trained)

            def step() -> None:
                model.zero_grad(set_to_none=True)
                backward_micro_batches(accelerator, model, rows, 4096, tokenizer.pad_token_id, loss_fn, share_prefix=share)

            seconds = best_of(args.reps, step)
            name = f"{precision} {'shared prefix' if share else 'one row per rollout'}"
            # fwd + bwd = 3 forwards' matmuls: 6 FLOPs per matmul parameter per forwarded token.
            gflops = 6 * limits["matmul_params"] * forwarded / seconds / 1e9
            out[name] = {"seconds": seconds, "forwarded_tokens": forwarded, "forwarded_tok_per_s": forwarded / seconds,
                         "trained_tok_per_s": trained / seconds, "gflops": gflops, "of_peak": gflops / limits[f"matmul_gflops_{precision}"]}
            print(f"update {name}: {seconds:.1f} s, {forwarded} forwarded tokens, {gflops:.0f} GFLOP/s ({out[name]['of_peak']:.0%} of {precision} peak)", flush=True)
    model.zero_grad(set_to_none=True)
    model.eval()
    return out


def step_settings(model: Any) -> dict[str, dict[str, Any]]:
    """The steps compared, named by what auto resolves to on this machine. "lean": False runs the
    sampler through transformers' forward, as envace did before the lean path; "share_prompts":
    False encodes each rollout's prompt in its own session, as envace did before it encoded a
    prompt once for the K rollouts that start from it (HFGenerator(share_prompts=...))."""
    from envace.training.setup import resolve_precision

    update = resolve_precision("auto")
    sampler = "bf16" if decode_settings("auto", model)["dtype"] == torch.bfloat16 else "fp32"
    return {
        "before (transformers' forward sampling, fp32 update, one row per rollout)": dict(precision="fp32", share_prefix=False, sampler_dtype="f32", lean=False,
                                                                                         share_prompts=False),
        f"previous (transformers' forward sampling, {update} update, shared prefix)": dict(precision="auto", share_prefix=True, sampler_dtype="f32", lean=False),
        f"now (lean {sampler} sampler, {update} update, shared prefix: the defaults)": dict(precision="auto", share_prefix=True),
        "now with --sampler-dtype int8": dict(precision="auto", share_prefix=True, sampler_dtype="int8"),
        "now with --continuous-batching": dict(precision="auto", share_prefix=True, continuous_batching=True),
        "now with --continuous-batching --sampler-dtype int8": dict(precision="auto", share_prefix=True, continuous_batching=True, sampler_dtype="int8"),
        "now with --sampler-dtype int4": dict(precision="auto", share_prefix=True, sampler_dtype="int4"),
        "now with --continuous-batching --sampler-dtype int4": dict(precision="auto", share_prefix=True, continuous_batching=True, sampler_dtype="int4"),
    }


def step_child(settings: dict[str, Any]) -> None:
    """One GRPO step of the demo's settings in this (fresh) process; prints its metrics as JSON
    with the process's peak RSS."""
    from envace.backends import hf
    from envace.config import build
    from envace.demo import peak_rss_gib
    from envace.training.trainer import TrainConfig, Trainer

    settings = dict(settings)
    if not settings.pop("lean", True):
        hf.lean_support = lambda model: "off for this benchmark row"
    if not settings.pop("share_prompts", True):
        hf.HFGenerator.__init__ = functools.partialmethod(hf.HFGenerator.__init__, share_prompts=False)
    for key in ("sampler_dtype", "continuous_batching"):  # rollout settings, given flat as on the command line
        if key in settings:
            settings["rollout"] = dict(settings["rollout"], **{key: settings.pop(key)})
    cfg = build(TrainConfig, dict(settings, steps=1, progress=False, tensorboard=False, save_every=1))
    metrics = Trainer(cfg).train_step()
    metrics["peak_rss_gib"] = peak_rss_gib()
    print("STEP_METRICS " + json.dumps(metrics))


def alternating(task: Any, traj: Any, ctx: Any) -> tuple[float, dict]:
    """The step benchmark's reward: 0 and 1 alternating within each group, so every group has a
    learning signal and the update always runs (with the real reward an untrained model's groups
    often score all 0 and the update is skipped, which would time nothing)."""
    return float(traj.group % 2), {}


def step(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    import subprocess
    import sys
    import tempfile

    demo = dict(model=args.model, init_from=args.init_from, variant="envace", tasks_per_step=2, k=args.k, lr=1e-5, difficulty=1, seed=0,
                reward="step_speed:alternating",  # the child runs this file as a script: benchmarks/ is on its path
                rollout=dict(max_turn_tokens=96, max_rehearse_tokens=128))
    out: dict[str, Any] = {}
    for name, settings in step_settings(model).items():
        with tempfile.TemporaryDirectory() as run_dir:
            child = json.dumps(dict(demo, **settings, output_dir=run_dir))
            proc = subprocess.run([sys.executable, __file__, "--child-step", child], capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("STEP_METRICS ")), None)
        if line is None:
            raise RuntimeError(f"the step '{name}' failed:\n{proc.stderr[-3000:]}")
        m = json.loads(line.removeprefix("STEP_METRICS "))
        out[name] = {k: m.get(k) for k in ("time/rollout_s", "time/update_s", "reward/mean", "policy/forwarded_tokens",
                                           "policy/forwarded_tokens_unshared", "policy/logprob_mismatch", "peak_rss_gib",
                                           "sampler/policy-rehearse/rows_per_decode_step", "sampler/policy-rehearse/generated_tokens",
                                           "sampler/policy-rehearse/prefill_tokens")}
        out[name]["step_s"] = m["time/rollout_s"] + m["time/update_s"]
        print(f"step {name}: {out[name]['step_s']:.1f} s (rollout {m['time/rollout_s']:.1f}, update {m['time/update_s']:.1f}), peak RSS {m['peak_rss_gib']:.1f} GiB", flush=True)
    return out


def llamacpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xllamacpp") is not None


def same_greedy_actions(model: Any, tokenizer: Any) -> dict[str, Any]:
    """Greedy real-mode rollouts of 10 fixed test tasks (2 per world, difficulty 1), each engine of
    hf_engines on the same model: identical ACT tokens to transformers' forward? For the lean paths
    also the logprob mismatch of the tokens both chose, until the first difference."""
    from envace.envs.environment import WorldEnvironment
    from envace.envs.tasks import builtin_tasks
    from envace.rollout import RolloutConfig, RolloutEngine
    from envace.types import Role

    tasks = builtin_tasks("test", 2, difficulty=1)
    # 4 rollouts in flight: every batch has <= lean.QUANT_MAX_ROWS rows, so the int8/int4 engines' copies
    # run (with all 10 at once, a base model's one long turn each never went below 9 rows).
    config = RolloutConfig(mode="real", temperature=0.0, max_turns=6, max_turn_tokens=96, max_active=4)
    acts, logprobs, out = {}, {}, {"tasks": len(tasks), "seconds": {}, "identical": {}, "logprob_mismatch": {}}
    engines = {name: (kw, config) for name, kw in hf_engines(model).items()}
    # The same fp32 numerics, rows paused and refilled: only the schedule differs.
    engines["envace HF, lean path, fp32, --continuous-batching"] = (dict(dtype=None, quant=None), dataclasses.replace(config, continuous_batching=True))
    for name, (kw, cfg) in engines.items():
        start = time.perf_counter()
        groups = RolloutEngine(HFGenerator(model, tokenizer, **kw), WorldEnvironment(), cfg).run(tasks, k=1)
        out["seconds"][name] = time.perf_counter() - start
        acts[name] = [[tok for turn in g[0].outputs(Role.ACT) for tok in turn.token_ids] for g in groups]
        logprobs[name] = [[lp for turn in g[0].outputs(Role.ACT) for lp in turn.logprobs] for g in groups]
    for name in engines:
        out["identical"][name] = sum(a == b for a, b in zip(acts[name], acts[REFERENCE]))
        gaps = []
        for a, b, la, lb in zip(acts[name], acts[REFERENCE], logprobs[name], logprobs[REFERENCE]):
            common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            gaps += [abs(x - y) for x, y in zip(la[:common], lb[:common])]
        out["logprob_mismatch"][name] = {"mean": sum(gaps) / max(1, len(gaps)), "max": max(gaps, default=0.0), "tokens": len(gaps)}
    return out


def table(r: dict[str, Any]) -> str:
    """The Markdown of docs/performance.md: every figure next to what bounds it, from this run."""
    m = r["machine"]
    # Ratios to the bf16 bound only where bf16 is native: an emulated bf16 "bound" is no limit.
    bounds = ("fp32", "bf16") if m.get("native_bf16", True) else ("fp32",)
    lines = [f"Machine now: fp32 matmul {m['matmul_gflops_fp32']:.0f} GFLOP/s, bf16 {m['matmul_gflops_bf16']:.1f} GFLOP/s"
             f"{'' if m.get('native_bf16', True) else ' (emulated: no native bf16)'}, "
             f"{m['threads']} threads; {m['matmul_params'] / 1e6:.0f}M matmul parameters, so the matmul-bound token rate is "
             f"{m['token_limit_fp32']:.0f} tok/s in fp32" + (f" and {m['token_limit_bf16']:.0f} in bf16." if "bf16" in bounds else "."), ""]
    if "decode" in r:
        d = r["decode"]
        lines += [f"Decode after a {d['prompt_tokens']}-token tool prompt, {d['new_tokens']} new tokens, greedy (aggregate tok/s):", "",
                  "| engine | batch 1 | batch 4 | batch 8 | batch 32 | " + " | ".join(f"batch 32 / {b} matmul bound" for b in bounds) + " |",
                  "|---|---|---|---|---|" + "---|" * len(bounds)]
        for name, v in d.items():
            if isinstance(v, dict):
                cells = [f"{v[b]['tok_per_s']:.1f}" if b in v else "" for b in ("batch1", "batch4", "batch8", "batch32")]
                ratios = [f"{v['batch32']['tok_per_s'] / m[f'token_limit_{b}']:.0%}" if "batch32" in v else "" for b in bounds]
                lines.append(f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} |")
        lines.append("")
    if "prefill" in r:
        p = r["prefill"]
        lines += [f"Prefill (8 different prompts, {p['tokens']} tokens): "
                  + "; ".join(f"{name}: {v['tok_per_s']:.0f} tok/s = " + ", ".join(f"{v['tok_per_s'] / m[f'token_limit_{b}']:.0%} of the {b} matmul bound" for b in bounds)
                              for name, v in p.items() if isinstance(v, dict)) + ".", ""]
    if "update" in r:
        u = r["update"]
        lines += [f"Update (forward + backward of the PPO loss, {u['rows']} rows = 2 tasks x K, {u['trained_tokens']:.0f} trained tokens):", "",
                  "| update | seconds | forwarded tokens | effective GFLOP/s | of that precision's matmul peak |", "|---|---|---|---|---|"]
        for name, v in u.items():
            if isinstance(v, dict):
                lines.append(f"| {name} | {v['seconds']:.1f} | {v['forwarded_tokens']} | {v['gflops']:.0f} | {v['of_peak']:.0%} |")
        lines.append("")
    if "step" in r:
        lines += ["GRPO step of the demo's settings (2 tasks x K=4, same seeds), each in its own process. Samplers of other "
                  "numerics draw other tokens from the same seeds, so the steps do different amounts of work; \"at the first "
                  "row's work\" scales each step's rollout seconds by the first row's generated tokens over its own and its update "
                  "seconds by the first row's unshared forwarded tokens over its own (an estimate: linear in each):", "",
                  "| settings | step s | speed-up | at the first row's work | rollout s | update s | generated tokens | prefilled tokens | "
                  "rows per decode step | forwarded tokens (unshared) | logprob mismatch | peak RSS GiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        first = next(iter(r["step"].values()))
        for name, v in r["step"].items():
            mismatch = "" if v.get("policy/logprob_mismatch") is None else f"{v['policy/logprob_mismatch']:.4f}"
            if v.get("policy/forwarded_tokens") is None:
                raise RuntimeError(f"the step '{name}' skipped its update: nothing was timed")
            rows = v.get("sampler/policy-rehearse/rows_per_decode_step")  # not in results from before 2026-12-07
            generated = v.get("sampler/policy-rehearse/generated_tokens")
            prefilled = v.get("sampler/policy-rehearse/prefill_tokens")  # not in older results
            equal_work = ""
            if generated and first.get("sampler/policy-rehearse/generated_tokens"):
                scaled = (v["time/rollout_s"] * first["sampler/policy-rehearse/generated_tokens"] / generated
                          + v["time/update_s"] * first["policy/forwarded_tokens_unshared"] / v["policy/forwarded_tokens_unshared"])
                equal_work = f"{first['step_s'] / scaled:.2f}x"
            lines.append(f"| {name} | {v['step_s']:.1f} | {first['step_s'] / v['step_s']:.2f}x | {equal_work} | "
                         f"{v['time/rollout_s']:.1f} | {v['time/update_s']:.1f} | "
                         f"{'' if generated is None else f'{generated:.0f}'} | {'' if prefilled is None else f'{prefilled:.0f}'} | "
                         f"{'' if rows is None else f'{rows:.1f}'} | "
                         f"{v['policy/forwarded_tokens']:.0f} ({v['policy/forwarded_tokens_unshared']:.0f}) | {mismatch} | {v['peak_rss_gib']:.1f} |")
        lines.append("")
    if "greedy" in r:
        g = r["greedy"]
        lines += [f"Greedy real-mode rollouts of {g['tasks']} fixed test tasks against transformers' forward (fp32):", "",
                  "| engine | tasks with identical actions | logprob mismatch on the common tokens (mean / max) | seconds |", "|---|---|---|---|"]
        for name, same in g["identical"].items():
            gap = g["logprob_mismatch"][name]
            lines.append(f"| {name} | {same}/{g['tasks']} | {gap['mean']:.4f} / {gap['max']:.4f} | {g['seconds'][name]:.0f} |")
        lines.append("")
    return "\n".join(lines)


def write_docs(text: str, command: str) -> None:
    doc = DOCS.read_text()
    block = f"{BEGIN}\n```bash\n{command}\n```\n\n{text}\n{END}"
    if BEGIN in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc += "\n" + block + "\n"
    DOCS.write_text(doc)


def main() -> None:
    import sys

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--init-from", default=None, help="checkpoint the GRPO step starts from (default: the base model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--reps", type=int, default=1, help="repetitions of each update measurement (the fastest counts)")
    p.add_argument("--skip", nargs="*", default=[], choices=[*SECTIONS, "greedy"])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--child-step", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.child_step:
        step_child(json.loads(args.child_step))
        return
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    results: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "machine": machine(model)}
    print(f"machine: {results['machine']}", flush=True)
    if "decode" not in args.skip:
        results["decode"] = decode(model, tokenizer, args)
    if "prefill" not in args.skip:
        results["prefill"] = prefill(model, tokenizer, args)
    if "update" not in args.skip:
        results["update"] = update(model, tokenizer, results["machine"], args)
    if "greedy" not in args.skip:
        results["greedy"] = same_greedy_actions(model, tokenizer)
    if "step" not in args.skip:
        results["step"] = step(model, args)
    # The matmul peak again at the end, and the better of the two: a shared machine measured once
    # can read low (the first run of this script measured 104 GFLOP/s fp32 at the start, while its
    # prefill alone then ran at 154% of that "bound").
    again = machine(model)
    results["machine"] = {k: max(v, again[k]) for k, v in results["machine"].items()}
    print(f"machine at the end: {again}", flush=True)
    results["seconds"] = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    text = table(results)
    print(text)
    if args.write_docs:
        write_docs(text, results["command"])
    print(f"done in {results['seconds'] / 60:.1f} min; wrote {args.out}")


if __name__ == "__main__":
    main()
