"""Decode throughput of a vLLM server (`--sampler vllm`) against the HF backend, same prompts,
side by side in one run, and the time of one weight push.

    python benchmarks/vllm_throughput.py --vllm-url http://127.0.0.1:8000/v1 --batch 8 --new-tokens 64

The server is started as in docs/scaling.md (same model, fp32). Both engines decode the same
`--batch` chat prompts greedily to exactly `--new-tokens` tokens (no stop), after one warm-up
call each. Writes benchmarks/results/vllm_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from envace.backends import HFGenerator, load_model
from envace.backends.base import PolicyWeights, SamplingParams
from envace.backends.vllm import VLLMServerGenerator

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Name three colours.", "Explain photosynthesis.",
             "How do I sort a list in Python?", "What is 17 times 23?", "Describe a cat.", "Why is the sky blue?"]


def prompts(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def decode_rate(gen, batch: list[list[int]], params: SamplingParams) -> float:
    """Generated tokens per second of one batched call (after a warm-up call)."""
    run_batch(gen, batch, params)  # warm-up: first-call costs (allocations, the server's lazy setup) are not decode
    start = time.perf_counter()
    generated = run_batch(gen, batch, params)
    return generated / (time.perf_counter() - start)


def run_batch(gen, batch: list[list[int]], params: SamplingParams) -> int:
    sessions = gen.open(len(batch))
    outs = gen.generate(sessions, batch, params)
    gen.close(sessions)
    return sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-url", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, device="cpu", dtype=torch.float32)
    batch = prompts(tok, args.batch)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)  # no stop: every row decodes new_tokens
    vllm = VLLMServerGenerator(args.vllm_url, tok)
    vllm.check_server()
    start = time.perf_counter()
    vllm.sync_weights(PolicyWeights(model, version=0))
    result = {"batch": args.batch, "new_tokens": args.new_tokens, "threads": args.threads,
              "sync_seconds": time.perf_counter() - start, "sync_bytes": vllm.stats.extra["sync_bytes"],
              "hf_tok_s": decode_rate(HFGenerator(model, tok), batch, params), "vllm_tok_s": decode_rate(vllm, batch, params)}
    vllm.shutdown()
    out = Path(__file__).parent / "results" / "vllm_throughput.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
