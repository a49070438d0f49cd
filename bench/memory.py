"""Peak memory of one training step of recipe=sft, dpo, kto, grpo, kd and ppo at Qwen's vocabulary (151,936), with the
logits made a chunk of tokens at a time (`trainer.models.chunked`, what the recipes run) against the whole
(batch, seq, vocab) logits (the way before), and against TRL 1.16's SFTTrainer, DPOTrainer, KTOTrainer and
GRPOTrainer on the same model and batch. CPU, float32.

    python bench/memory.py                                  # every case, lengths 512 .. 8192
    python bench/memory.py --cases dpo --lengths 4097       # one case

The model is a tiny-layer Qwen2 made by transformers from its config class (hidden 64, 1 layer, untied output),
saved once into --dir; our side loads it with `trainer.models.hf.from_hf`, TRL's side with transformers. Each
measurement runs in a fresh subprocess and reports its peak resident memory: the process's high-water RSS
(`resource.getrusage(...).ru_maxrss`, Linux), which includes the interpreter, torch and the model (the `base`
column: our process's RSS just before the step, the model loaded; TRL's, the trainer built). A step: sft one row
of `length` tokens (the loss on its second half); dpo one pair, chosen and rejected `length` tokens each, against
a frozen reference copy; grpo 4 completions of a 64-token prompt, rows of `length` tokens, the reference's
log-probs then the policy's loss (loss_type=dapo) and its backward (TRL's step also generates the completions:
generation holds one token's logits at a time); kd one row, the teacher a second copy, forward KL (the whole
way: one chunk of every token). The whole-logits baselines run only where their logits hold at most
--whole-tokens rows (kd: both models'; the machine this was written on has 24 GiB, shared): the ratio shows at
the lengths where both run. TRL's GRPO step runs up to --trl-grpo-length (its generation, token by token, is
slow on a CPU).
kto's step: two unpaired rows of `length` tokens (a prompt of a quarter, then the completion), one desirable, and
their two mismatched KL sequences, against a frozen reference copy (TRL's: KTOTrainer on the same two rows).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

VOCAB = 151_936
PROMPT = 64  # grpo's prompt tokens
GENERATIONS = 4
# sequences of `length` tokens a step holds
ROWS = {"sft": 1, "dpo": 2, "kto": 2, "grpo": GENERATIONS, "kd": 1, "ppo": 1}
# rows of (length, vocab) logits the whole way holds
LOGITS = {"sft": 1, "dpo": 2, "kto": 2, "grpo": GENERATIONS, "kd": 2, "ppo": 1}
TRL_CASES = ("sft", "dpo", "kto", "grpo")


def _rss_gb() -> float:
    with open("/proc/self/status") as status:
        kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kb / 2**20


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


def make_model(path: str) -> None:
    """The tiny-layer Qwen2 of the bench, saved with a word-level tokenizer of its vocabulary (w0, w1, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16_384,
                         tie_word_embeddings=False, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)


def _whole_logps(h, w, y):
    """The way before: the whole (batch, seq, vocab) logits, then the log-probabilities."""
    import torch.nn.functional as F

    from trainer.models.chunked import IGNORE

    logits = F.linear(h, w).float()
    return -F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="none").view(y.shape)


def _whole_logps_entropy(h, w, y, temperature):
    """The way before for ppo: the whole logits, then the log-probabilities and the entropy."""
    import torch

    from trainer.models.chunked import IGNORE

    logits = torch.nn.functional.linear(h, w).float() / temperature
    logps = torch.log_softmax(logits, -1)
    entropy = -(logps.exp() * logps).sum(-1).detach()
    return logps.gather(-1, y.clamp(min=0)[..., None])[..., 0] * (y != IGNORE), entropy


def _ppo(model, tokens, mode: str):
    """One PPO step on one rollout (`tokens`, 1 row): the rollout's reads, its targets, the loss."""
    import copy
    import functools

    import torch

    from trainer.config.recipe import RecipeConfig
    from trainer.models import chunked, score
    from trainer.recipes import ppo

    reference = copy.deepcopy(model).requires_grad_(False)
    value = score.attach(copy.deepcopy(model))
    target = tokens[:, 1:].clone()
    target[:, : PROMPT - 1] = chunked.IGNORE
    way = chunked.token_logps_entropy if mode == "chunked" else _whole_logps_entropy
    fn = functools.partial(way, temperature=0.7)

    def completion(x):
        return x[:, PROMPT - 1:]

    with torch.no_grad():
        old, ref = (completion(m(tokens[:, :-1], target, loss_fn=fn)[0]) for m in (model, reference))
        old_values = completion(value(tokens[:, :-1])[..., 0])
    lengths = torch.tensor([old.shape[1]])
    adv, returns, _ = ppo.rollout_targets(old, ref, old_values, torch.ones(1), lengths, RecipeConfig(name="ppo"))
    logps = completion(model(tokens[:, :-1], target, loss_fn=fn)[0])
    mask = torch.ones_like(old, dtype=torch.bool)
    loss, _ = ppo.ppo_loss(logps, completion(value(tokens[:, :-1])[..., 0]), old, old_values, adv, returns, mask,
                           mask, 0.2, 0.2, 0.1)
    return loss


def _ours(case: str, mode: str, length: int, path: str) -> tuple[float, float]:
    """One step of `case` on our model; returns the loss and the RSS before the step (the model loaded)."""
    import copy
    import functools

    import torch
    import torch.nn.functional as F

    from trainer.data.packing import Packed
    from trainer.models import chunked
    from trainer.models.hf import from_hf
    from trainer.recipes import dpo, grpo, kd

    torch.manual_seed(0)
    model = from_hf(path)
    base = _rss_gb()
    logps_fn = chunked.token_logps if mode == "chunked" else _whole_logps
    tokens = torch.randint(0, VOCAB - 2, (ROWS[case], length))
    if case == "sft":
        target = tokens[:, 1:].clone()
        target[:, : length // 2] = chunked.IGNORE
        if mode == "chunked":
            loss = model(tokens[:, :-1], target)
        else:
            loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), target.flatten())
    elif case == "dpo":
        reference = copy.deepcopy(model).requires_grad_(False)
        target = tokens[:, 1:].clone()  # the chosen row and the rejected one, each after a prompt of length / 4
        target[:, : length // 4] = chunked.IGNORE
        settings = {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0}
        loss, _ = dpo.pair_loss(model, reference, Packed(tokens, target, seq=length - 1), settings, logps_fn)
    elif case == "kto":
        loss = _kto_step(model, tokens, length, logps_fn)
    elif case == "grpo":
        reference = copy.deepcopy(model).requires_grad_(False)
        target = tokens[:, 1:].clone()
        target[:, : PROMPT - 1] = chunked.IGNORE
        with torch.no_grad():
            ref = reference(tokens[:, :-1], target, loss_fn=logps_fn)
        logps = model(tokens[:, :-1], target, loss_fn=logps_fn)
        mask = target != chunked.IGNORE
        loss, _ = grpo.grpo_loss(logps, logps.detach(), torch.randn(GENERATIONS), mask, 0.2, None, 0.04, ref,
                                 "dapo", tokens_per_rank=mask.sum())
    elif case == "ppo":
        loss = _ppo(model, tokens, mode)
    else:
        teacher = copy.deepcopy(model).requires_grad_(False)
        with torch.no_grad():
            h_t = teacher(tokens[:, :-1], loss_fn=lambda h, w, y: h)
        chunk = 1024 if mode == "chunked" else length
        settings = {"loss": "forward_kl", "temperature": 1.0, "alpha": 0.5, "chunk_tokens": chunk}
        fn = functools.partial(kd.kd_loss, h_t=h_t, w_t=teacher.output_weight.detach(), **settings)
        loss, _ = model(tokens[:, :-1], tokens[:, 1:], loss_fn=lambda h, w, y: fn(h, w, targets=y))
    loss.backward()
    return float(loss), base


def _kto_step(model, tokens, length: int, logps_fn):
    """recipe=kto's loss of two unpaired rows (`trainer.data.unpaired`'s: prompt, then completion) of `length`
    tokens, one desirable, with their KL sequences, against a frozen copy."""
    import copy

    import torch

    from trainer.recipes import kto

    reference = copy.deepcopy(model).requires_grad_(False)
    prompt = length // 4
    rows = torch.zeros(2, 2 * length, dtype=torch.long)
    rows[:, :prompt], rows[:, length:2 * length - prompt] = tokens[:, :prompt], tokens[:, prompt:]
    lengths = torch.tensor([[prompt, length - prompt]] * 2)
    micro, _, _ = kto.micro_batch(rows, lengths, torch.tensor([1, 0]), "padding_free", kl=True)
    settings = {"beta": 0.1, "loss_type": "kto", "desirable_weight": 1.0, "undesirable_weight": 1.0}
    return kto.unpaired_loss(model, reference, micro, settings, logps_fn)[0]


def completion_lengths(completions, **kwargs):
    """The bench's GRPO reward: anything cheap (the memory does not depend on it)."""
    return [float(len(c)) for c in completions]


def _trl(case: str, length: int, path: str) -> tuple[float, float]:
    """One training step of TRL's trainer for `case` on the same model and batch; returns the loss and the RSS
    before the step (the trainer built)."""
    import random

    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    tok = PreTrainedTokenizerFast.from_pretrained(path)  # AutoTokenizer would take Qwen2's class from config.json
    model = AutoModelForCausalLM.from_pretrained(path)

    def words(n):
        return " ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(n))

    common = {"output_dir": tempfile.mkdtemp(), "max_steps": 1, "report_to": [], "use_cpu": True,
              "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True}
    if case == "sft":
        ids = [rng.randrange(VOCAB - 2) for _ in range(length)]
        completion = [0] * (length // 2) + [1] * (length - length // 2)
        data = Dataset.from_list([{"input_ids": ids, "completion_mask": completion}])
        args = trl.SFTConfig(max_length=length, per_device_train_batch_size=1, **common)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    elif case == "dpo":
        data = Dataset.from_list([{"prompt": words(length // 4), "chosen": words(length - length // 4 - 1),
                                   "rejected": words(length - length // 4 - 1)}])
        args = trl.DPOConfig(max_length=2 * length, per_device_train_batch_size=1, beta=0.1, **common)
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    elif case == "kto":
        data = Dataset.from_list([{"prompt": words(length // 4), "completion": words(length - length // 4 - 1),
                                   "label": label} for label in (True, False)])
        args = trl.KTOConfig(max_length=length, per_device_train_batch_size=2, beta=0.1, **common)
        trainer = trl.KTOTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    else:
        data = Dataset.from_list([{"prompt": words(PROMPT)}] * GENERATIONS)
        args = trl.GRPOConfig(num_generations=GENERATIONS, per_device_train_batch_size=GENERATIONS,
                              max_completion_length=length - PROMPT, beta=0.04, **common)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=completion_lengths, args=args, train_dataset=data,
                                  processing_class=tok)
    base = _rss_gb()
    return float(trainer.train().training_loss), base


def child(spec: dict) -> None:
    import torch

    torch.set_num_threads(2)
    if spec["mode"] == "trl":
        loss, base = _trl(spec["case"], spec["length"], spec["dir"])
    else:
        loss, base = _ours(spec["case"], spec["mode"], spec["length"], spec["dir"])
    print(json.dumps({"peak_gb": _peak_gb(), "base_gb": base, "loss": loss}))


def measure(case: str, mode: str, length: int, path: str, timeout: int) -> dict | None:
    spec = json.dumps({"case": case, "mode": mode, "length": length, "dir": path})
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:80]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4097, 8192])
    parser.add_argument("--whole-tokens", type=int, default=2048,
                        help="run the whole-logits way only where the step holds at most this many tokens")
    parser.add_argument("--trl-tokens", type=int, default=16_384, help="run TRL's trainer up to this many tokens")
    parser.add_argument("--trl-grpo-length", type=int, default=512,
                        help="the longest rows TRL's GRPO step runs at (it generates them token by token)")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "trainjob-bench-memory-qwen2"))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        make_model(args.dir)
    print("| case | length | tokens | chunked GB | whole GB | whole / chunked | TRL 1.16 GB | TRL / chunked "
          "| base GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        for length in args.lengths:
            tokens = ROWS[case] * length
            row = {"chunked": measure(case, "chunked", length, args.dir, args.timeout)}
            if LOGITS[case] * length <= args.whole_tokens:
                row["whole"] = measure(case, "whole", length, args.dir, args.timeout)
            trl_runs = tokens <= args.trl_tokens and (case != "grpo" or length <= args.trl_grpo_length)
            if case in TRL_CASES and not args.no_trl and trl_runs:
                row["trl"] = measure(case, "trl", length, args.dir, args.timeout)
            print(_line(case, length, tokens, row), flush=True)


def _line(case: str, length: int, tokens: int, row: dict) -> str:
    def gb(key):
        got = row.get(key)
        if got is None:
            return "-"
        return got["error"] if "error" in got else f"{got['peak_gb']:.2f}"

    def ratio(key):
        a, b = row.get(key), row.get("chunked")
        if not a or not b or "error" in a or "error" in b:
            return "-"
        return f"{a['peak_gb'] / b['peak_gb']:.2f}x"

    base = row["chunked"].get("base_gb")
    return (f"| {case} | {length} | {tokens} | {gb('chunked')} | {gb('whole')} | {ratio('whole')} | {gb('trl')} | "
            f"{ratio('trl')} | {'-' if base is None else f'{base:.2f}'} |")


if __name__ == "__main__":
    main()
