"""SFT throughput in real (non-padding) tokens per second for each `data.packing` (max_length, longest,
padding_free) against TRL 1.16's SFTTrainer at its defaults, at its defaults with `padding_free=True`, and at
its defaults with our CPU arithmetic (`bf16=False`: fp32 as our train.mixed_precision=auto on the CPU, and
`gradient_checkpointing=False`): the same tiny Qwen2-shaped model, the same conversations (lengths spread from 16
to 1,024 tokens), the same batch of rows per step, at data.seq_len=2048, one torch thread each, on the CPU.

    python bench/packing.py                    # 64 conversations, 7 steps of 8, 2 rounds
    python bench/packing.py --rows 96 --rounds 3

TRL's defaults on the CPU are bf16 autocast (`bf16` defaults to True), gradient checkpointing, padding to the
longest row of the batch, SDPA attention, and the loss over every token (`assistant_only_loss=False`);
the line above the table says whether this CPU does bf16 natively (AVX512-BF16 or AMX), without which bf16
autocast runs far slower than fp32.

Ours runs `python -m trainer` (recipe=sft, data=chat, data.shuffle=false, one metrics line a step) and reads
the real tokens and step times of its metrics lines; TRL's trainer runs the same conversations (our train
split, in order) with a callback that times each step, its real tokens being the rows' token counts. Each
round runs every configuration once, the order turned by one each round, and each figure pools the steps
after the first of every round. Each step is timed twice: wall seconds, and the CPU seconds of the training
process (ours: `Trainer._train_step` timed by a `sitecustomize` the bench puts on our ranks' path; TRL's: its
callback). With one thread the two agree on an idle machine; on a shared one a step's wall time is mostly
waiting for other jobs, so the ratios are taken over CPU seconds. The table is in docs/fine-tuning.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

VOCAB = 1024
SEQ_LEN = 2048
BATCH = 8
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <eos> "
    "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
)


def make_model(path: str) -> None:
    """A tiny Qwen2 (hidden 128, 2 layers, 4 heads, 2 key-value heads, 1,024 tokens) with a word-level tokenizer
    (w0, w1, ...: one token a word) and a chat template marking the assistant's turns."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=VOCAB - 1,
        pad_token_id=VOCAB - 2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


# Put on our ranks' path as sitecustomize: appends each training step's process CPU seconds (and wall seconds) to
# $PACKING_BENCH_STEPS, as TRL's callback below times its steps.
STEP_TIMER = textwrap.dedent('''
    import importlib.abc, importlib.util, json, os, sys, time

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "trainer.training.loop":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                step = module.Trainer._train_step

                def timed(self, batch):
                    cpu, wall = time.process_time(), time.perf_counter()
                    loss, norm = step(self, batch)
                    float(loss), float(norm)  # the step's work done
                    with open(os.environ["PACKING_BENCH_STEPS"], "a") as f:
                        f.write(json.dumps([time.process_time() - cpu, time.perf_counter() - wall]) + "\\n")
                    return loss, norm

                module.Trainer._train_step = timed

            spec.loader.exec_module = exec_module
            return spec

    if os.environ.get("PACKING_BENCH_STEPS"):
        sys.meta_path.insert(0, _Finder())
''')


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` conversations of 16 to 1,024 tokens (a user turn, then the assistant's, then its end token)."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        total = rng.randint(16, 1024)
        user = rng.randint(4, total // 2)

        def words(k):
            return " ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(k))

        chats.append(
            [{"role": "user", "content": words(user)}, {"role": "assistant", "content": words(total - user - 1)}]
        )
    return chats


def train_split(chats: list[list[dict]], path: str) -> list[list[dict]]:
    """The conversations our corpus trains on (data.eval_percent unset: 2% of the rows, by their ids, are eval)."""
    name = os.path.basename(path)
    return [c for i, c in enumerate(chats) if zlib.crc32(f"{name}:{i}".encode()) % 10_000 >= 200]


Steps = tuple[list[int], list[float], list[float]]  # real tokens, CPU seconds, wall seconds of each step


def ours(model: str, data: str, how: tuple[str, ...], steps: int, work: str) -> Steps:
    """Each step after the first of a run of `steps` steps under data.packing=`how[0]` and the overrides
    `how[1:]` (peft=lora): its real tokens and wall seconds from the metrics lines, its CPU seconds from
    `STEP_TIMER`."""
    packing, *overrides = how
    run_dir = os.path.join(work, f"run-{packing}-{time.time_ns()}")
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "model=hf",
        f"model.path={model}",
        "recipe=sft",
        "data=chat",
        f"data.path={data}",
        f"data.seq_len={SEQ_LEN}",
        f"data.packing={packing}",
        "data.shuffle=false",
        f"data.cache_dir={os.path.join(work, 'cache')}",
        f"train.global_batch_size={BATCH}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.progress=false",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    timer, timed = os.path.join(work, "timer"), f"{run_dir}.steps.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([timer, REPO]), "PACKING_BENCH_STEPS": timed}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"our run ({packing}) failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f][1:]
    with open(timed) as f:
        cpu = [json.loads(line)[0] for line in f][1:]
    return [m["tokens"] for m in lines], cpu, [m["step_time_s"] for m in lines]


# TRL's configurations beside its defaults: the name's suffix and SFTConfig's settings.
TRL_RUNS = {
    "(defaults)": {},
    "padding_free=True": {"padding_free": True},
    "bf16=False, no grad. checkpointing": {"bf16": False, "gradient_checkpointing": False},
}
# LoRA: our peft section's defaults (rank 8, alpha 16, no dropout, the attention's projections), given to
# both sides alike; TRL takes them as a peft LoraConfig.
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
OUR_LORA = ("peft=lora", f"peft.rank={LORA['r']}", f"peft.alpha={LORA['lora_alpha']}",
            f"peft.dropout={LORA['lora_dropout']}", f"peft.target_modules=[{','.join(LORA['target_modules'])}]")


def trl(model: str, chats: list[list[dict]], how: tuple[dict, bool], steps: int, work: str) -> Steps:
    """Each step after the first of TRL's SFTTrainer on `chats`, in order, `steps` steps, with `how[0]`'s settings
    over its defaults, and with `how[1]` peft's LoRA (`LORA`): the rows' real tokens, its CPU and wall seconds."""
    settings, lora = how
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cpu, wall = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.began = time.process_time(), time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            cpu.append(time.process_time() - self.began[0])
            wall.append(time.perf_counter() - self.began[1])

    torch.manual_seed(0)
    # The word-level tokenizer as saved (AutoTokenizer would rebuild Qwen2's byte-level one from config.json).
    tok = PreTrainedTokenizerFast.from_pretrained(model)
    rows = chats[: steps * BATCH]
    padding_free = settings.get("padding_free", False)
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-", dir=work),
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        report_to=[],
        # padding_free enforces no max_length; at the defaults the rows are shorter than its 1,024
        max_length=None if padding_free else 1024,
        save_strategy="no",
        logging_steps=steps,
        use_cpu=True,
        dataloader_drop_last=True,
        seed=0,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        **settings,
    )
    peft = {}
    if lora:
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(task_type="CAUSAL_LM", **LORA)
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        args=config,
        processing_class=tok,
        train_dataset=Dataset.from_list([{"messages": c} for c in rows]),
        callbacks=[Timer()],
        **peft,
    )
    lengths = [len(r) for r in trainer.train_dataset["input_ids"]]
    trainer.train()
    per_step = [sum(lengths[i * BATCH : (i + 1) * BATCH]) for i in range(1, steps)]
    return per_step, cpu[1:], wall[1:]


def native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (oneDNN's AVX512-BF16 or AMX)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def rate(tokens: list[int], seconds: list[float]) -> float:
    """The median over steps of each step's real tokens over its seconds (robust to a busy machine)."""
    return statistics.median(t / s for t, s in zip(tokens, seconds, strict=True))


def configurations(data: str, train: list[list[dict]]) -> dict[str, tuple]:
    """Every run by name: (its function, its rows, how), full fine-tuning's then LoRA's (whose names end in
    "LoRA")."""
    runs = {f"trainjob data.packing={p}": (ours, data, (p,)) for p in ("max_length", "longest", "padding_free")}
    runs |= {f"TRL 1.16 SFTTrainer {name}": (trl, train, (settings, False)) for name, settings in TRL_RUNS.items()}
    runs["trainjob data.packing=padding_free LoRA"] = (ours, data, ("padding_free", *OUR_LORA))
    for name in ("(defaults)", "bf16=False, no grad. checkpointing"):
        runs[f"TRL 1.16 SFTTrainer {name} LoRA"] = (trl, train, (TRL_RUNS[name], True))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="conversations (the train split: about 98%% of them)")
    parser.add_argument("--rounds", type=int, default=2, help="times each configuration runs, interleaved")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's threads, ours and TRL's alike (on a shared "
        "machine one thread each is the fair measure: parallel regions wait for the slowest thread)",
    )
    parser.add_argument("--only", choices=("all", "full", "lora"), default="all",
                        help="the runs of full fine-tuning, of LoRA, or all")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = torch_threads = str(args.threads)  # our runs' processes read it
    import torch

    torch.set_num_threads(args.threads)  # TRL's, in this process
    with tempfile.TemporaryDirectory() as work:
        model, data = os.path.join(work, "model"), os.path.join(work, "chats.jsonl")
        make_model(model)
        os.makedirs(os.path.join(work, "timer"))
        with open(os.path.join(work, "timer", "sitecustomize.py"), "w") as f:
            f.write(STEP_TIMER)
        chats = conversations(args.rows)
        with open(data, "w") as f:
            f.writelines(json.dumps({"messages": c}) + "\n" for c in chats)
        train = train_split(chats, data)
        steps = len(train) // BATCH
        runs = {name: run for name, run in configurations(data, train).items()
                if args.only == "all" or (args.only == "lora") == name.endswith("LoRA")}
        results: dict[str, Steps] = {name: ([], [], []) for name in runs}
        order = list(runs)
        for round_ in range(args.rounds):
            for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
                fn, rows, how = runs[name]
                for pooled, got in zip(results[name], fn(model, rows, how, steps, work), strict=True):
                    pooled.extend(got)
    print(
        f"SFT, {steps} steps of {BATCH} conversations (16..1024 tokens), data.seq_len={SEQ_LEN}, CPU "
        f"({'native' if native_bf16() else 'no native'} bf16), {torch_threads} thread(s), {args.rounds} interleaved "
        "round(s); each figure the median over the steps after the first of each step's real tokens over its "
        "seconds; the ratio is trainjob's padding_free (with LoRA for the LoRA rows) over CPU seconds\n"
    )
    table(results, args.rounds)


def table(results: dict[str, Steps], rounds: int) -> None:
    """The markdown table of `results`, each row's ratio against our padding_free run of its kind (LoRA or not)."""
    cpu_rates = {name: rate(r[0], r[1]) for name, r in results.items()}
    wall_rates = {name: rate(r[0], r[2]) for name, r in results.items()}
    wide = max(len(name) for name in results)
    print(
        f"| {'run':<{wide}} | {'real tokens':>11} | {'CPU s/step':>10} | {'wall s/step':>11} | {'tok/CPU s':>9} "
        f"| {'tok/wall s':>10} | {'padding_free is':>15} |"
    )
    print(f"|{'-' * (wide + 2)}|{'-' * 12}:|{'-' * 11}:|{'-' * 12}:|{'-' * 10}:|{'-' * 11}:|{'-' * 16}:|")
    for name, (tokens, cpu, wall) in results.items():
        base = cpu_rates.get("trainjob data.packing=padding_free" + (" LoRA" if name.endswith("LoRA") else ""))
        ratio = f"{base / cpu_rates[name]:>14.2f}x" if base else f"{'-':>15}"
        print(
            f"| {name:<{wide}} | {sum(tokens) // rounds:>11} | {statistics.median(cpu):>10.3f} "
            f"| {statistics.median(wall):>11.3f} | {cpu_rates[name]:>9.0f} | {wall_rates[name]:>10.0f} "
            f"| {ratio} |"
        )


if __name__ == "__main__":
    main()
