"""Peak memory per rank while loading a sharded Hugging Face checkpoint under fsdp2 (`model=hf`).

    python bench/hf_load_memory.py                       # Llama-3-8B-shaped tensors, 2 layers, 2 ranks
    python bench/hf_load_memory.py --shape 1b --layers 16   # the whole Llama 3.2 1B shape

Writes a random bf16 checkpoint of the chosen shape (one safetensors file per layer, as the Hub shards
them, plus an index) into --dir (kept for reruns), then starts `--nproc` ranks with torchrun; each builds
the model on the meta device, shards it with FSDP2 as `strategy=fsdp2` does, and loads the weights with
`trainer.models.hf.load_weights`, while a thread samples its resident anonymous memory (RssAnon: what the
rank allocates; the safetensors files are memory-mapped, and their pages are the kernel's page cache).
The table compares each rank's growth during the load with its fp32 shard plus the largest tensor (bf16
as stored): the bound when a rank reads only its own slices, one tensor at a time, never a whole copy.
`--layers` keeps the tensors' shapes and cuts the depth, so that an 8B-shaped load fits a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# The repository in place of bench/ on the path: its scripts' names (kernels, datacache, coverage) are
# installed packages', which transformers and pytest import.
sys.path[:] = [REPO, *(p for p in sys.path if os.path.realpath(p or ".") != os.path.join(REPO, "bench"))]

SHAPES = {
    # Llama 3 8B and Llama 3.2 1B (tied embeddings), as their config.json describe them.
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
}
MIB = 2**20


def write_checkpoint(path: str, shape: dict) -> None:
    """A LlamaForCausalLM directory of random bf16 weights, one safetensors file per layer plus an index."""
    import torch
    from safetensors.torch import save_file

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        **shape,
    }
    d, f, h, kv = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    kv_dim = d // h * kv
    files: list[dict] = [{"model.embed_tokens.weight": (shape["vocab_size"], d), "model.norm.weight": (d,)}]
    if not shape["tie_word_embeddings"]:
        files[0]["lm_head.weight"] = (shape["vocab_size"], d)
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        files.append(
            {
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kv_dim, d),
                p + "self_attn.v_proj.weight": (kv_dim, d),
                p + "self_attn.o_proj.weight": (d, d),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
            }
        )
    os.makedirs(path, exist_ok=True)
    weight_map = {}
    for n, tensors in enumerate(files):
        name = f"model-{n + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(
            {k: torch.randn(s, dtype=torch.bfloat16) * 0.02 for k, s in tensors.items()},
            os.path.join(path, name),
            metadata={"format": "pt"},
        )
        weight_map.update(dict.fromkeys(tensors, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fp:
        json.dump({"metadata": {}, "weight_map": weight_map}, fp)
    with open(os.path.join(path, "config.json"), "w") as fp:  # last: its presence marks a complete directory
        json.dump(config, fp)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(path: str, out: str) -> None:
    """One rank: shard the model with FSDP2 and load it, sampling memory; rank results go to `out`."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from safetensors import safe_open

    from trainer.config import StrategyConfig
    from trainer.models import hf
    from trainer.parallel import ParallelDims, parallelize

    dist.init_process_group("gloo")
    strategy = OmegaConf.merge(OmegaConf.structured(StrategyConfig), {"name": "fsdp2", "dp_shard": -1})
    dims = ParallelDims.from_config(strategy, dist.get_world_size())
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = hf.build(path)
    model = parallelize(model, dims, strategy)
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    largest = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    s = f.get_slice(key)
                    numel = 1
                    for n in s.get_shape():
                        numel *= n
                    largest = max(largest, numel * 2)  # bf16 as stored
    dist.barrier()
    before, peak, done = _rss_anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    started = time.perf_counter()
    hf.load_weights(model, path)
    seconds = time.perf_counter() - started
    done.set()
    thread.join()
    peak[0] = max(peak[0], _rss_anon())
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(
        rows,
        {"rank": dist.get_rank(), "shard": shard, "largest": largest, "growth": peak[0] - before, "seconds": seconds},
    )
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks to write (the depth)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "trainjob-bench-hf"))
    parser.add_argument("--worker", nargs=2, metavar=("PATH", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    shape = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
    path = os.path.join(args.dir, f"{args.shape}-{args.layers}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"writing a random {args.shape}-shaped checkpoint with {args.layers} layers to {path}", flush=True)
        write_checkpoint(path, shape)
    out = os.path.join(path, "result.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        os.path.abspath(__file__),
        "--worker",
        path,
        out,
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(out) as f:
        rows = json.load(f)
    on_disk = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))
    print(
        f"\n{args.shape}-shaped, {args.layers} layers, {on_disk / MIB:.0f} MiB of bf16 safetensors in "
        f"{on_disk and len([n for n in os.listdir(path) if n.endswith('.safetensors')])} files, fsdp2 on "
        f"{args.nproc} ranks"
    )
    print(
        "| rank | fp32 shard (MiB) | largest tensor (MiB) | bound: shard + tensor | peak growth while loading "
        "(MiB) | within | load (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        bound = r["shard"] + r["largest"]
        print(
            f"| {r['rank']} | {r['shard'] / MIB:.0f} | {r['largest'] / MIB:.0f} | {bound / MIB:.0f} | "
            f"{r['growth'] / MIB:.0f} | {'yes' if r['growth'] <= bound else 'NO'} | {r['seconds']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
