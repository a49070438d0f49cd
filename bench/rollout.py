"""Rollout speed: our `trainer.generate` against `transformers`' `generate` on the same model, prompts and lengths,
then one recipe=grpo run's step split into generation, scoring and training.

The model is a small Llama or Qwen2 built by `transformers` from its config class (random weights, nothing
downloaded), saved, and loaded by each side from that directory: ours through `trainer.models.from_hf` (what
`python -m trainer.generate` and model=hf load), theirs with `AutoModelForCausalLM.from_pretrained`, both fp32 on
this machine's CPU (or first GPU). Each batch holds prompts of mixed lengths; a set of end tokens makes rows end at
different steps, as a policy's completions do. Both sample with the same seed and warpers (or decode greedily) and
give the same tokens (checked); tokens/s counts each row's completion up to its end token, the same for both.
Each figure is the best of `--repeats` timed runs after a warmup, the two sides run in turn.

The GRPO part runs `python -m trainer` (recipe=grpo, model=hf on that directory) for a few steps, with generation
in the step and with recipe.generation.async=true, and reads the metrics lines: `perf/generate_s`,
`perf/rollout_wait_s` (async: how long the step waited for the background), `perf/score_s` (the reward functions
and the reward model) and `perf/logps_s` (the old and reference log-probabilities) that the recipe records, and
the loop's `step_time_s`; training is the rest.

    python bench/rollout.py [--family llama,qwen2] [--batch 16] [--new 64] [--repeats 3] [--grpo-steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

from tests.trainer.hf_models import add_tokenizer  # noqa: E402
from trainer.generate import generate, left_padded  # noqa: E402
from trainer.models import from_hf  # noqa: E402
from trainjob.run_files import read_metrics  # noqa: E402

SHAPE = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}
END_TOKENS = list(range(2, 2 + 96))  # about 1% of the vocabulary: a row of a random model ends after ~85 tokens


def make_model(family: str, root: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config, cls = ((LlamaConfig(**SHAPE), LlamaForCausalLM) if family == "llama"
                   else (Qwen2Config(**SHAPE, tie_word_embeddings=True), Qwen2ForCausalLM))
    path = os.path.join(root, family)
    cls(config).save_pretrained(path)
    return add_tokenizer(path)  # a small byte-level BPE with a chat template: model=hf reads prompts with it


def _best_times(fns: list, repeats: int) -> tuple[list[float], list]:
    """The best of `repeats` timed runs of each of `fns` (after a warmup of each), run in turn so that a shared
    machine's load weighs on each alike; and each one's last output."""
    outs = [fn() for fn in fns]
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            outs[i] = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best[i] = min(best[i], time.perf_counter() - start)
    return best, outs


def _until_end(row: list[int], eos: set[int]) -> list[int]:
    return next((row[: i + 1] for i, t in enumerate(row) if t in eos), row)


def compare(path: str, batch: int, new: int, repeats: int, sample: bool) -> dict:
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(200, SHAPE["vocab_size"], (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 96, (batch,), generator=gen)]
    warpers = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}
    ours = from_hf(path).to(device).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    tokens, valid = left_padded(prompts, 0, device)

    def mine():
        torch.manual_seed(1)
        return generate(ours, prompts, new, eos=END_TOKENS, pad=0, **warpers)

    def hf():
        torch.manual_seed(1)
        with torch.no_grad():
            out = theirs.generate(input_ids=tokens, attention_mask=valid.long(), max_new_tokens=new,
                                  do_sample=sample, eos_token_id=END_TOKENS, pad_token_id=0, **warpers)
        return [_until_end(row, set(END_TOKENS)) for row in out[:, tokens.shape[1]:].tolist()]

    (t_mine, t_hf), (a, b) = _best_times([mine, hf], repeats)
    count = sum(len(r) for r in a)
    return {"ours_tok_s": count / t_mine, "hf_tok_s": count / t_hf, "same_tokens": a == b, "tokens": count,
            "lengths": f"{min(len(r) for r in a)}-{max(len(r) for r in a)}"}


def grpo_split(path: str, steps: int, overlap: bool) -> dict:
    """The mean per-step seconds of a GRPO run's generation, scoring, log-probs and training (after the first
    step), with recipe.generation.async=`overlap`."""
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "prompts.jsonl")
        with open(data, "w") as f:
            gen = torch.Generator().manual_seed(0)
            for _ in range(64):
                words = " ".join(str(int(t)) for t in torch.randint(0, 999, (12,), generator=gen))
                f.write(json.dumps({"prompt": words}) + "\n")
        run = os.path.join(tmp, "run")
        proc = subprocess.run(
            [sys.executable, "-m", "trainer", "model=hf", f"model.path={path}", "recipe=grpo", "data=prompts",
             f"data.path={data}", "data.seq_len=64", "data.eval_percent=10", "recipe.num_generations=8",
             "train.global_batch_size=32", "recipe.max_completion_length=64", "train.progress=false",
             "recipe.reward_funcs=[tests.trainer.grpo_rewards:lowercase]", f"train.max_steps={steps}",
             f"train.eval_every={steps}", "train.eval_batches=1", "train.log_every=1",
             f"recipe.generation.async={str(overlap).lower()}", f"hydra.run.dir={run}"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        lines = [m for m in read_metrics(run) if "loss" in m][1:]  # the first step warms up
    keys = ("step_time", "generate", "rollout_wait", "score", "logps")
    out = {k: sum(m.get(f"perf/{k}_s", m.get(f"{k}_s", 0.0)) for m in lines) / len(lines) for k in keys}
    exposed = out["rollout_wait"] if overlap else out["generate"]  # the generation the step waited for
    out["train"] = out["step_time"] - exposed - out["score"] - out["logps"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="llama,qwen2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grpo-steps", type=int, default=4, help="0: skip the GRPO run")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        print("| model | mode | batch | new tokens | rows' lengths | ours tok/s | transformers tok/s | ratio | "
              "same tokens |\n|---|---|---|---|---|---|---|---|---|")
        paths = {family: make_model(family, root) for family in args.family.split(",")}
        for family, path in paths.items():
            for sample in (False, True):
                r = compare(path, args.batch, args.new, args.repeats, sample)
                print(f"| {family} | {'sampled' if sample else 'greedy'} | {args.batch} | {args.new} | {r['lengths']} "
                      f"| {r['ours_tok_s']:.0f} | {r['hf_tok_s']:.0f} | {r['ours_tok_s'] / r['hf_tok_s']:.2f}x "
                      f"| {r['same_tokens']} |", flush=True)
        if args.grpo_steps:
            family, path = next(iter(paths.items()))
            print(f"\nrecipe=grpo on {family}, 32 completions of 4 prompts a step, up to 64 tokens each "
                  "(seconds per step, mean after the first)\n")
            print("| generation | step | generating | waited for it | scoring | old/ref log-probs | training |\n"
                  "|---|---|---|---|---|---|---|")
            for overlap in (False, True):
                s = grpo_split(path, args.grpo_steps, overlap)
                print(f"| {'async' if overlap else 'in the step'} | {s['step_time']:.2f} | {s['generate']:.2f} | "
                      f"{s['rollout_wait'] if overlap else s['generate']:.2f} | {s['score']:.3f} | {s['logps']:.2f} | "
                      f"{s['train']:.2f} |", flush=True)

if __name__ == "__main__":
    main()
