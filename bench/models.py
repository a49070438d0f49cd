"""Training-step throughput and peak memory per model family: trainjob's own decoder (`model.impl=native`) against
transformers' modeling code (`model.impl=transformers`), at the same shapes.

Each family's tiny model is built by transformers from its own config class and saved with `save_pretrained`; each
row is then the shipped path, `python -m trainer model=hf model.path=DIR model.impl=IMPL` (pretraining on the byte
corpus), run in a child forked from this process once the trainer is imported, so that a row costs no interpreter
start. Tokens/s is the median of the metrics lines' `tokens_per_s` after `--warmup` steps. Peak memory is the
metrics' `peak_memory_gb`: on CUDA torch's `max_memory_allocated`; on CPUs the child's RSS high-water mark, given
here above the RSS this process had when it forked the child (the interpreter and its imports: the child starts
with them, as a fresh `python -m trainer` would; printed too).

The family list is data (`FAMILIES`): a native row runs where the architecture is native in this checkout
(`trainer.config.hf.ARCHITECTURES`), else it is skipped with the reason; a family whose config class this
transformers lacks is skipped likewise.

    python bench/models.py [--shapes tiny,small] [--families Llama,GPT-NeoX] [--steps 8] [--warmup 3] [override ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]
from trainjob.run_files import RunDir, read_metrics  # noqa: E402

# The shapes: transformers' config keys (shared by every family), then the run's batch.
SHAPES = {
    "tiny": {"config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2}, "seq_len": 64, "batch": 8},
    "small": {"config": {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
                         "num_attention_heads": 8, "num_key_value_heads": 4}, "seq_len": 256, "batch": 8},
}
# family -> (config class, model class, what the family adds to the shape: a function of the shape's config)
FAMILIES = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", lambda c: {}),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", lambda c: {}),
    "Mistral": ("MistralConfig", "MistralForCausalLM", lambda c: {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", lambda c: {"head_dim": _head_dim(c)}),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", lambda c: {
        "head_dim": _head_dim(c), "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": c["intermediate_size"] // 2}),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", lambda c: {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "Gemma 2": ("Gemma2Config", "Gemma2ForCausalLM", lambda c: {"head_dim": _head_dim(c)}),
    "Gemma 3": ("Gemma3TextConfig", "Gemma3ForCausalLM", lambda c: {"head_dim": _head_dim(c)}),
    "Phi-3": ("Phi3Config", "Phi3ForCausalLM", lambda c: {}),
    "SmolLM3": ("SmolLM3Config", "SmolLM3ForCausalLM", lambda c: {}),
    "OLMo 2": ("Olmo2Config", "Olmo2ForCausalLM", lambda c: {}),
    "Granite": ("GraniteConfig", "GraniteForCausalLM", lambda c: {}),
    "GPT-NeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM", lambda c: {}),
    "StableLM": ("StableLmConfig", "StableLmForCausalLM", lambda c: {}),
    "Starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", lambda c: {}),
    "Cohere": ("CohereConfig", "CohereForCausalLM", lambda c: {}),
    "Falcon": ("FalconConfig", "FalconForCausalLM", lambda c: {
        "new_decoder_architecture": True, "num_kv_heads": c["num_key_value_heads"]}),
}
TOKENS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "max_position_embeddings": 1024}


def _head_dim(config: dict) -> int:
    """A head width apart from hidden / heads (twice it), as Qwen3 and Gemma ship."""
    return 2 * config["hidden_size"] // config["num_attention_heads"]


def make(family: str, shape: str, root: str) -> str | None:
    """The directory of `family`'s tiny model at `shape`, saved by transformers; None where this transformers
    has no such config class."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config_class, model_class, extra = FAMILIES[family]
    if not hasattr(transformers, config_class):
        return None
    base = SHAPES[shape]["config"]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**base, **TOKENS, **extra(base))
    path = os.path.join(root, f"{family}-{shape}".replace(" ", "_"))
    getattr(transformers, model_class)(config).save_pretrained(path)
    return path


def rss_gb() -> float:
    """This process's resident memory now."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20


def run(args: list[str], run_dir: str) -> tuple[int, str, float]:
    """`python -m trainer *args` in a forked child; (its exit code, its last stderr line, this process's RSS when
    it forked, GiB)."""
    import runpy

    with tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        at_fork = rss_gb()
        pid = os.fork()
        if pid == 0:
            os.dup2(err.fileno(), 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            sys.argv = ["trainer", *args, f"hydra.run.dir={run_dir}"]
            sys.modules.pop("trainer.__main__", None)
            code = 1
            try:
                runpy.run_module("trainer", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        lines = [line for line in err.read().decode(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return os.waitstatus_to_exitcode(status), (errors or lines or [""])[-1], at_fork


def measure(path: str, impl: str, shape: str, steps: int, warmup: int, overrides: list[str], tmp: str) -> dict:
    s = SHAPES[shape]
    run_dir = os.path.join(tmp, f"{os.path.basename(path)}-{impl}")
    code, last, at_fork = run(["model=hf", f"model.path={path}", f"model.impl={impl}", f"data.seq_len={s['seq_len']}",
                      f"train.global_batch_size={s['batch']}", f"train.max_steps={steps}",
                      f"train.eval_every={steps * 10}", f"train.checkpoint_every={steps * 10}", "train.eval_batches=1",
                      "train.progress=false", "train.log_every=1", "lr_schedule.warmup_steps=1", *overrides], run_dir)
    if code != 0:
        return {"note": f"exit {code}: {last[:90]}"}
    lines = [m for m in read_metrics(run_dir) if "tokens_per_s" in m]
    with open(RunDir.of(run_dir).rank_log(0)) as f:
        cuda = "device cuda" in f.read()
    peak = max(line["peak_memory_gb"] for line in lines)
    return {"tokens_per_s": statistics.median(line["tokens_per_s"] for line in lines[warmup:] or lines),
            "peak_mib": (peak - (0 if cuda else at_fork)) * 1024, "loss": lines[-1]["loss"], "note": "",
            "at_fork_mib": at_fork * 1024}


def rows(families: list[str], shapes: list[str], steps: int, warmup: int, overrides: list[str], tmp: str):
    """One row per family, shape and impl, printed as it is measured."""
    from trainer.config.hf import ARCHITECTURES

    at_fork = []
    print(f"{'family':<11}{'shape':<7}{'impl':<14}{'tokens/s':>10}{'peak MiB':>10}{'loss':>8}  note", flush=True)
    for shape in shapes:
        for family in families:
            path = make(family, shape, tmp)
            if path is None:
                print(f"{family:<11}{shape:<7}{'-':<14}{'':>10}{'':>10}{'':>8}  skipped: transformers has no "
                      f"{FAMILIES[family][0]}", flush=True)
                continue
            for impl in ("native", "transformers"):
                if impl == "native" and FAMILIES[family][1] not in ARCHITECTURES:
                    row = {"note": f"skipped: {FAMILIES[family][1]} is not native in this checkout"}
                else:
                    row = measure(path, impl, shape, steps, warmup, overrides, tmp)
                    at_fork += [row["at_fork_mib"]] if "at_fork_mib" in row else []
                cells = (f"{row['tokens_per_s']:>10.0f}{row['peak_mib']:>10.0f}{row['loss']:>8.3f}"
                         if "tokens_per_s" in row else f"{'':>10}{'':>10}{'':>8}")
                print(f"{family:<11}{shape:<7}{impl:<14}{cells}  {row['note']}", flush=True)
    return at_fork


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,small", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated family names")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="more overrides for every run (strategy=..., kernels=...)")
    args = parser.parse_args()
    families, shapes = args.families.split(","), args.shapes.split(",")
    unknown = [f for f in families if f not in FAMILIES] + [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}; families are {', '.join(FAMILIES)}; shapes {', '.join(SHAPES)}")
    import transformers  # noqa: F401

    import trainer.__main__  # noqa: F401  what every forked run shares: the trainer, torch, Hydra, transformers

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TRAINJOB_CACHE", os.path.join(tmp, "cache"))
        at_fork = rows(families, shapes, args.steps, args.warmup, args.overrides, tmp)
    print(f"\npeak MiB: on CPUs the run's RSS high-water mark above this process's RSS when it forked the run "
          f"({min(at_fork, default=0):.0f} to {max(at_fork, default=0):.0f} MiB: the interpreter and its imports); "
          f"on CUDA torch.cuda.max_memory_allocated. tokens/s: median of the metrics lines after {args.warmup} "
          f"steps of {args.steps}.")


if __name__ == "__main__":
    main()
