"""`train.qat`: quantization-aware training with torchao (`int8_dynamic_act_int4_weight`: int8 activations
quantised per token at run time, int4 weights in groups of `train.qat_group_size` along each row), the schemes and
the rules that tie them to the rest of the config. No torch here: the driver imports it."""

from __future__ import annotations

from trainer.errors import ConfigError

SCHEMES = ("none", "int8_dynamic_act_int4_weight")


def check(cfg) -> None:
    """Raise ConfigError when train.qat cannot run with the rest of `cfg` (the typed config)."""
    t, m = cfg.train, cfg.model
    if t.qat not in SCHEMES:
        raise ConfigError("train.qat", t.qat, f"must be one of {', '.join(SCHEMES)}")
    if t.qat == "none":
        return
    if not t.qat_group_size > 0:
        raise ConfigError("train.qat_group_size", t.qat_group_size, "must be > 0")
    for key in ("dim", "ffn_dim"):  # every linear layer's input width is one of these
        if getattr(m, key) % t.qat_group_size:
            raise ConfigError("train.qat_group_size", t.qat_group_size, f"must divide model.{key}={getattr(m, key)} "
                              "(weights are quantised in groups along each row)")
    if cfg.peft.name != "none":
        raise ConfigError("train.qat", t.qat, "fake-quantises the model's own linear layers; with "
                          f"peft={cfg.peft.name} they are frozen and the adapters beside them stay unquantised: use "
                          "peft=none")
    if cfg.kernels.name == "triton":
        raise ConfigError("train.qat", t.qat, "fake-quantises the linear layers in PyTorch; kernels=triton fuses the "
                          "output layer into its loss, which would skip it: use kernels=torch")
    if cfg.strategy.tp != 1:  # -1: the rest of the world
        raise ConfigError("train.qat", t.qat, "torchao's fake quantisation takes whole weights; "
                          f"strategy={cfg.strategy.name} splits them over tensor-parallel ranks: use strategy=ddp or "
                          "fsdp2")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ConfigError("train.qat", t.qat, "needs torchao: pip install 'trainjob[qat]'") from None
