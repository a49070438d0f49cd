"""`python -m trainer.generate SOURCE --prompt TEXT [--prompt TEXT ...]`: completions from a trained model.

SOURCE is a training checkpoint (`<run_dir>/checkpoints/step-<N>`, any strategy, LoRA adapters on) or a Hugging
Face model directory. The text goes through the model's own tokenizer: the Hugging Face directory's (the run's
`model.path` for a `model=hf` checkpoint), or the byte tokenizer of a built-in preset. `--chat` sends each prompt
as a user message through the directory's chat template, with the generation prompt. Generation stops at an end
token (the tokenizer's eos_token and every `eos_token_id` of generation_config.json, else of config.json) or
after --max-new-tokens. Greedy by default; --temperature > 0 samples, from --top-k / --top-p / --min-p when given.
Every argument is checked, and the prompts tokenized, before any weight is read: a bad one is refused in one
line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from trainer.data.text import Text
from trainer.errors import ConfigError
from trainer.generate import generate, sampling
from trainjob.cli import OneLineParser


def _source(path: str):
    """(model loader, tokenizer directory or None, positions the model has) of SOURCE; checks it first."""
    from trainer import export
    from trainer.config.hf import local_model
    from trainer.config.hf_impl import choose, read
    from trainer.models import hf, hf_transformers

    path = local_model(path, "SOURCE")  # a model's URL (hf://, s3://, gs://): its fetched copy
    if os.path.isfile(os.path.join(path, ".metadata")):
        cfg = export.run_config(path)
        hf_dir = None
        if cfg.model.name == "hf":
            cfg.model.path = local_model(cfg.model.path, "model.path (of the run)")
            choose(cfg.model.path, cfg.model.get("impl"), key="model.path (of the run)")
            hf_dir = cfg.model.path
        return (lambda: export.load_model(path, cfg)), hf_dir, int(cfg.model.max_seq_len)
    if os.path.isfile(os.path.join(path, "config.json")):
        impl, settings = read(path, "SOURCE")
        loader = hf_transformers if impl == "transformers" else hf
        return (lambda: loader.from_hf(path)), path, settings["max_seq_len"]
    raise ConfigError("SOURCE", path, "must be a checkpoint (<run_dir>/checkpoints/step-<N>, holding .metadata) "
                      "or a Hugging Face model directory (holding config.json)")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m trainer.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="SOURCE", help="a checkpoint directory, or a Hugging Face model "
                        "directory or its URL (hf://<org>/<name>[@<revision>], s3://<bucket>/<prefix>, gs://...)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat it for a batch")
    parser.add_argument("--chat", action="store_true", help="send each prompt as a user message of the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the top-p nucleus (1: all)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than min-p x the most likely one (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt (prompt, completion, token_ids) instead of the text")
    return parser


def _check(args) -> None:
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", args.max_new_tokens, "must be >= 1")
    for name, value, allowed in sampling.problems(args.temperature, args.top_k, args.top_p, args.min_p):
        raise ConfigError("--" + name.replace("_", "-"), value, allowed)
    if not all(args.prompt):
        raise ConfigError("--prompt", "", "every prompt needs some text")


def run(args) -> list[dict]:
    """The completion of each prompt, {"prompt", "completion", "token_ids"}; raises ConfigError before any
    weight is read."""
    _check(args)
    load, hf_dir, positions = _source(args.source)
    text = Text(hf_dir)
    prompts = [text.encode([{"role": "user", "content": p}] if args.chat else p) for p in args.prompt]
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > positions:
        raise ConfigError("--max-new-tokens", args.max_new_tokens,
                          f"the longest prompt is {longest} tokens, and the model has {positions} positions")
    model = load().eval()
    gen = torch.Generator().manual_seed(args.seed)
    outputs = generate(model, prompts, args.max_new_tokens, eos=text.eos, pad=text.pad, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, generator=gen, min_p=args.min_p)
    return [{"prompt": p, "completion": text.decode(ids), "token_ids": ids}
            for p, ids in zip(args.prompt, outputs, strict=True)]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        results = run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for result in results:
        print(json.dumps(result) if args.json else result["completion"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
