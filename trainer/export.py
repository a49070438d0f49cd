"""`python -m trainer.export CHECKPOINT OUT`: a Hugging Face model directory from a training checkpoint.

CHECKPOINT is `<run_dir>/checkpoints/step-<N>`, written under any strategy and world size (DCP gathers the
shards); the run's `config.yaml` says which model it holds. OUT gets `config.json`, `model.safetensors`
(fp32, Hugging Face's tensor names) and, for a `model=hf` run, the tokenizer and generation files of the
model directory it started from, so that `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads it.
A built-in preset is written as a `LlamaForCausalLM` (its byte tokenizer has no Hugging Face files); a
`model.impl=transformers` run as transformers' `save_pretrained` writes its model. A
`peft=lora` run gives its adapters as PEFT saves them (`peft.PeftModel.from_pretrained(base, OUT)` loads
them), or with `--merge` the whole model with the adapters folded in. With `--quantize`, OUT also gets the
model's linear weights in torchao's int8-dynamic-activation, int4-weight form (`quantized.pt`,
`quantization.json`; `trainer.models.qat.load(OUT)` loads them): the conversion that ends a `train.qat` run, in
its `train.qat_group_size` groups, or post-training quantisation of any other run's model (groups of 32). A
`recipe=reward` run gives a `*ForSequenceClassification` with one label (its `score` head, and the pad_token_id it
scores by) that `transformers.AutoModelForSequenceClassification.from_pretrained(OUT)` loads.

OUT must not exist yet (nothing a user made is overwritten); it is written under a temporary name and
renamed when complete.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile

import torch
from omegaconf import DictConfig, OmegaConf

from trainer import models
from trainer.checkpoint import fs as checkpoint_fs
from trainer.checkpoint import store
from trainer.checkpoint.checks import damage
from trainer.checkpoint.layout import is_checkpoint
from trainer.checkpoint.writing import config_of
from trainer.config.hf import local_model
from trainer.config.hf_impl import choose
from trainer.errors import ConfigError
from trainer.models import hf, hf_transformers, lora, score
from trainjob.cli import OneLineParser
from trainjob.files import directory_problem, nearest_existing

# Files of a model directory that describe how to tokenize and generate, copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def run_config(checkpoint: str) -> DictConfig:
    """The resolved config of the run that wrote `checkpoint` (`<run_dir>/checkpoints/step-<N>`)."""
    if not is_checkpoint(checkpoint):
        raise ConfigError(
            "CHECKPOINT",
            checkpoint,
            "must be a checkpoint directory such as <run_dir>/checkpoints/step-100 (it holds a .metadata file, or "
            "DeepSpeed's deepspeed.json)",
        )
    path = config_of(checkpoint)
    if not checkpoint_fs.isfile(path):
        raise ConfigError(
            "CHECKPOINT",
            checkpoint,
            f"its run's config {path} is missing: the checkpoint must stay in <run_dir>/checkpoints/ (or its "
            "train.checkpoint_dir)",
        )
    problem = damage(checkpoint)
    if problem:
        raise ConfigError("CHECKPOINT", checkpoint, f"cannot be loaded: {problem}")
    try:
        with checkpoint_fs.open(path, "r") as f:
            cfg = OmegaConf.load(f)
    except Exception as e:  # YAML and OmegaConf raise many kinds: one line naming the file
        raise ConfigError("CHECKPOINT", checkpoint, f"its run's config {path} cannot be read: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(cfg, DictConfig) or "model" not in cfg:
        raise ConfigError("CHECKPOINT", checkpoint, f"its run's config {path} is not a run's config (no model)")
    return cfg


def load_model(checkpoint: str, cfg: DictConfig) -> torch.nn.Module:
    """The model of `checkpoint`, whole, in fp32 on the CPU (DCP's shards, or DeepSpeed's ZeRO partitions,
    gathered: `trainer.checkpoint.store.load_model`)."""
    with torch.device("meta"):
        model = models.build(cfg.model)
        if _reward(cfg):
            score.attach(model)
        model = lora.apply(model, _peft(cfg))
    model.to_empty(device="cpu")
    absent = store.load_model(checkpoint, model)
    if absent:
        raise ConfigError("CHECKPOINT", checkpoint, f"holds no {absent[0]} of the run's model")
    model.init_buffers()
    return model


def _peft(cfg: DictConfig) -> DictConfig:
    return cfg.get("peft") or OmegaConf.create({"name": "none"})  # configs saved before peft existed


def _reward(cfg: DictConfig) -> bool:
    """Whether the run trained a reward model (recipe=reward): a score head instead of the LM head."""
    return (cfg.get("recipe") or {}).get("name") == "reward"


def _classifier(config: dict, cfg: DictConfig) -> dict:
    """`config` (a causal LM's config.json) as a one-label *ForSequenceClassification's, padded as the run's
    preference rows were (the score is read at the last token that is not pad_token_id)."""
    from trainer.data.chat import padding_id
    from trainer.data.hf_tokenizer import HFTokenizer

    family = config["architectures"][0].replace("ForCausalLM", "").replace("ForSequenceClassification", "")
    config["architectures"] = [f"{family}ForSequenceClassification"]
    config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    config.pop("num_labels", None)
    if cfg.model.name == "hf":
        config["pad_token_id"] = padding_id(HFTokenizer(cfg.model.path))
    return config


def hf_config(cfg: DictConfig) -> dict:
    """config.json for the exported model: the source directory's for `model=hf`, else a Llama config."""
    m = cfg.model
    if m.name == "hf":
        with open(os.path.join(m.path, "config.json")) as f:
            config = json.load(f)
    else:
        from trainer.data import tokenizer

        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": m.dim,
            "intermediate_size": m.ffn_dim,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads,
            "vocab_size": m.vocab_size,
            "max_position_embeddings": m.max_seq_len,
            "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta,
            "tie_word_embeddings": m.tie_embeddings,
            "hidden_act": "silu",
            "bos_token_id": tokenizer.BOS,
            "eos_token_id": tokenizer.EOS,
            "pad_token_id": tokenizer.PAD,
        }
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    return _classifier(config, cfg) if _reward(cfg) else config


def write(model: torch.nn.Module, cfg: DictConfig, out: str, quantize: tuple[str, int] | None = None) -> None:
    """Write the Hugging Face directory `out` (which must not exist) for `model`: the whole model, or, when
    it holds LoRA adapters, the adapters as PEFT saves them (adapter_config.json, adapter_model.safetensors);
    with `quantize` (scheme, group size), torchao's quantised form of the model beside its fp weights."""
    from safetensors.torch import save_file

    out = os.path.abspath(out)
    existed = nearest_existing(os.path.dirname(out))
    tmp = None
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=os.path.dirname(out))
        params = dict(model.named_parameters())
        if any(lora.is_adapter(name) for name in params):
            family = None if isinstance(model, hf_transformers.TransformersModel) else hf.family_of(model)
            tensors = lora.peft_state({n: p.detach() for n, p in params.items() if lora.is_adapter(n)}, family)
            save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
                json.dump(lora.adapter_config(_peft(cfg), cfg.model.path, family), f, indent=2)
        elif isinstance(model, hf_transformers.TransformersModel):
            hf_transformers.save_pretrained(model, tmp)
        else:
            head = "score" if _reward(cfg) else "lm_head"
            tensors = hf.hf_state({name: p.detach() for name, p in params.items()}, hf.family_of(model), head)
            tensors = {name: t.contiguous() for name, t in tensors.items()}
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(hf_config(cfg), f, indent=2)
            if quantize:
                from trainer.models import qat

                qat.save(qat.quantize(copy.deepcopy(model), *quantize), *quantize, tmp)
        if cfg.model.name == "hf":
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(cfg.model.path, name)):
                    shutil.copy2(os.path.join(cfg.model.path, name), tmp)
        os.rename(tmp, out)
    except BaseException:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        parent = os.path.dirname(out)
        while parent != existed and parent.startswith(existed) and not os.listdir(parent):  # made here
            os.rmdir(parent)
            parent = os.path.dirname(parent)
        raise


def _quantization(cfg: DictConfig, checkpoint: str, merge: bool) -> tuple[str, int]:
    """(scheme, group size) of `--quantize` for the run `cfg`; ConfigError when its model cannot take them."""
    if cfg.model.get("impl") == "transformers":
        raise ConfigError("--quantize", True, "quantises trainjob's own decoder; this run's model ran through "
                          "transformers (model.impl=transformers)")
    train = cfg.get("train") or {}
    scheme = train.get("qat") if train.get("qat") not in (None, "none") else "int8_dynamic_act_int4_weight"
    group = int(train.get("qat_group_size") or 32)
    if _peft(cfg).name == "lora" and not merge:
        raise ConfigError("--quantize", True, f"{checkpoint} holds LoRA adapters: add --merge to quantise the whole "
                          "model with them folded in")
    for key in ("dim", "ffn_dim"):
        if int(cfg.model[key]) % group:
            raise ConfigError("--quantize", True, f"int4 groups of {group} (train.qat_group_size) must divide "
                              f"model.{key}={cfg.model[key]}")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ConfigError("--quantize", True, "needs torchao: pip install 'trainjob[qat]'") from None
    return scheme, group


def export(checkpoint: str, out: str, merge: bool = False, quantize: bool = False) -> str:
    """Write `out` from `checkpoint` (with `merge`, LoRA adapters folded into the weights); return `out`.
    Raises ConfigError before writing anything."""
    if os.path.exists(out):
        raise ConfigError("OUT", out, "already exists: give a new directory (nothing is overwritten)")
    problem = directory_problem(out)
    if problem:
        raise ConfigError("OUT", out, f"{problem}; the model directory is written there")
    cfg = run_config(checkpoint)
    if merge and _peft(cfg).name != "lora":
        raise ConfigError(
            "--merge",
            True,
            f"folds LoRA adapters into the weights; {checkpoint} was trained with "
            f"peft={_peft(cfg).name}, so there is nothing to merge",
        )
    if cfg.model.name == "hf":  # still a directory that the run's impl loads (a URL: its fetched copy)
        cfg.model.path = local_model(cfg.model.path, "model.path (of the run)")
        choose(cfg.model.path, cfg.model.get("impl"), key="model.path (of the run)")
    scheme = _quantization(cfg, checkpoint, merge) if quantize else None
    model = load_model(checkpoint, cfg)
    write(lora.merge(model) if merge else model, cfg, out, scheme)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory, <run_dir>/checkpoints/step-<N>")
    parser.add_argument("out", help="the Hugging Face model directory to write (must not exist)")
    parser.add_argument(
        "--merge", action="store_true", help="fold a LoRA run's adapters into the weights and write the whole model"
    )
    parser.add_argument(
        "--quantize", action="store_true", help="also write the int8-activation, int4-weight form of torchao (QAT's)"
    )
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.out, merge=args.merge, quantize=args.quantize)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk filled while writing: nothing of OUT is left
        print(f"error: could not write {args.out}: {e.strerror or e} ({e.filename or args.out})", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
