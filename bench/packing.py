"""SFT throughput in real (non-padding) tokens per second for each `data.packing` (max_length, longest,
padding_free) against TRL 1.16's SFTTrainer at its defaults (padding to the longest row of the batch) and with
`padding_free=True`: the same tiny Qwen2-shaped model, the same conversations (lengths spread from 16 to
1,024 tokens), the same batch of rows per step, at data.seq_len=2048, on the CPU.

    python bench/packing.py                    # 64 conversations, 7 steps of 8
    python bench/packing.py --rows 96          # more

Ours runs `python -m trainer` (recipe=sft, data=chat, data.shuffle=false, one metrics line a step) and reads
the real tokens and step times of its metrics lines; TRL's trainer runs the same conversations (our train
split, in order) with a callback that times each step, its real tokens being the rows' token counts. The
table is in docs/fine-tuning.md.
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


def ours(model: str, data: str, packing: str, steps: int, work: str) -> tuple[list[int], list[float]]:
    """(real tokens, seconds) of each step after the first of a run of `steps` steps under data.packing=`packing`."""
    run_dir = os.path.join(work, f"run-{packing}")
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
    ]
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"our run ({packing}) failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return [m["tokens"] for m in lines[1:]], [m["step_time_s"] for m in lines[1:]]


def trl(
    model: str, chats: list[list[dict]], padding_free: bool, steps: int, work: str
) -> tuple[list[int], list[float]]:
    """(real tokens, seconds) of each step after the first of TRL's SFTTrainer on `chats`, in order, `steps` steps."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class Timer(TrainerCallback):
        seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            Timer.seconds.append(time.perf_counter() - self.began)

    torch.manual_seed(0)
    # The word-level tokenizer as saved (AutoTokenizer would rebuild Qwen2's byte-level one from config.json).
    tok = PreTrainedTokenizerFast.from_pretrained(model)
    rows = chats[: steps * BATCH]
    config = SFTConfig(
        output_dir=os.path.join(work, f"trl-{padding_free}"),
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        padding_free=padding_free,
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
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        args=config,
        processing_class=tok,
        train_dataset=Dataset.from_list([{"messages": c} for c in rows]),
        callbacks=[Timer()],
    )
    lengths = [len(r) for r in trainer.train_dataset["input_ids"]]
    trainer.train()
    per_step = [sum(lengths[i * BATCH : (i + 1) * BATCH]) for i in range(1, steps)]
    return per_step, Timer.seconds[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="conversations (the train split: about 98%% of them)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's threads, ours and TRL's alike (on a shared "
        "machine one thread each is the fair measure: parallel regions wait for the slowest thread)",
    )
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = torch_threads = str(args.threads)  # our runs' processes read it
    import torch

    torch.set_num_threads(args.threads)  # TRL's, in this process
    with tempfile.TemporaryDirectory() as work:
        model, data = os.path.join(work, "model"), os.path.join(work, "chats.jsonl")
        make_model(model)
        chats = conversations(args.rows)
        with open(data, "w") as f:
            f.writelines(json.dumps({"messages": c}) + "\n" for c in chats)
        train = train_split(chats, data)
        steps = len(train) // BATCH
        results = {
            f"trainjob data.packing={p}": ours(model, data, p, steps, work)
            for p in ("max_length", "longest", "padding_free")
        }
        results["TRL 1.16 SFTTrainer (defaults)"] = trl(model, train, False, steps, work)
        results["TRL 1.16 SFTTrainer padding_free=True"] = trl(model, train, True, steps, work)
    rates = {name: statistics.median(t / s for t, s in zip(*r, strict=True)) for name, r in results.items()}
    base = rates["trainjob data.packing=padding_free"]
    print(
        f"SFT, {steps} steps of {BATCH} conversations (16..1024 tokens), data.seq_len={SEQ_LEN}, CPU"
        f", {torch_threads} thread(s); the median over the steps after the "
        "first of each step's real tokens over its time\n"
    )
    print(f"| {'run':<40} | {'real tokens':>11} | {'mean step s':>11} | {'real tok/s':>10} | {'padding_free is':>15} |")
    print(f"|{'-' * 42}|{'-' * 12}:|{'-' * 12}:|{'-' * 11}:|{'-' * 16}:|")
    for name, (tokens, seconds) in results.items():
        line = f"| {name:<40} | {sum(tokens):>11} | {statistics.mean(seconds):>11.3f} | {rates[name]:>10.0f} |"
        print(f"{line} {base / rates[name]:>14.2f}x |")


if __name__ == "__main__":
    main()
