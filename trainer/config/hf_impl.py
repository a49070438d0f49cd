"""`model.impl`: which code runs a `model=hf` directory. `native` is trainjob's own decoder (where our kernels and
tensor-parallel plans apply; the architectures of `trainer.config.hf.ARCHITECTURES`); `transformers` is the
directory's own modeling code in transformers, for any causal LM transformers can build. Left unset, the
directory's config.json chooses: native where the architecture is native and our decoder takes its settings,
else transformers, with the reason (`choose`).

No torch here: whether transformers knows the architecture is read from the text of its auto-mapping files
(`transformers_problem`); the ranks build the model and say what transformers says (`trainer.models.hf_transformers`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

from trainer.config import hf
from trainer.errors import ConfigError

IMPLS = ("native", "transformers")

# The model.* keys of the transformers path, each from the first of its config.json spellings that is present
# (config classes rename them through `attribute_map`); None: required.
_SETTINGS = {
    "dim": (("hidden_size", "n_embd", "d_model"), None),
    "n_layers": (("num_hidden_layers", "n_layer", "num_layers"), None),
    "n_heads": (("num_attention_heads", "n_head", "num_heads"), None),
    "n_kv_heads": (("num_key_value_heads", "num_kv_heads", "n_head_kv"), "n_heads"),
    "ffn_dim": (("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim"), "4 dim"),
    "vocab_size": (("vocab_size",), None),
    "max_seq_len": (("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"), 2048),
    "rope_theta": (("rope_theta", "rotary_emb_base"), 10000.0),
    "norm_eps": (("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"), 1e-5),
    "tie_embeddings": (("tie_word_embeddings",), True),  # transformers' PretrainedConfig default
}


def _read(path: str | None, key: str) -> dict:
    """config.json of directory `path` after the checks every impl shares (a directory with intact safetensors)."""
    config = hf.read_json(path, key)
    hf.check_weights(path, key)
    return config


def _native_problem(path: str, key: str) -> str | None:
    """Why trainjob's own decoder cannot run the directory (its refusal), or None."""
    try:
        hf.read_config(path, key)
    except ConfigError as e:
        return e.allowed
    return None


def transformers_problem(config: dict) -> str | None:
    """Why transformers (as installed here) cannot build the directory's causal LM, or None. Read from the text
    of transformers' auto mappings, without importing it; where transformers is not installed on this machine
    the ranks' machine decides (they build the model before the first step)."""
    archs = config.get("architectures") or []
    if len(archs) != 1:
        return f"config.json names the architectures {archs or '(none)'}; trainjob needs exactly one causal LM"
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin:
        return None
    auto = os.path.join(os.path.dirname(spec.origin), "models", "auto")
    try:
        with open(os.path.join(auto, "modeling_auto.py")) as f:
            known = f'"{archs[0]}"' in f.read()
    except OSError:
        return None
    if known:
        return None
    version = importlib.metadata.version("transformers")
    remote = " (config.json's auto_map points at the model's own code, which trainjob does not run)" if (
        "auto_map" in config) else ""
    return f"its architecture {archs[0]} is not a causal LM transformers {version} can build{remote}"


def choose(path: str | None, impl: str | None, key: str = "model.path") -> tuple[str, str]:
    """(the impl that runs directory `path`, why) for `model.impl=impl` (None: chosen here). Raises ConfigError
    when the impl asked for cannot run it, or neither can."""
    if impl is not None and impl not in IMPLS:
        raise ConfigError("model.impl", impl, f"must be one of {', '.join(IMPLS)} (or unset: chosen from config.json)")
    config = _read(path, key)
    arch = (config.get("architectures") or ["(none given)"])[0]
    native_problem = _native_problem(path, key) if impl != "transformers" else None
    if impl == "native" and native_problem:
        raise ConfigError(key, path, f"{native_problem}; model.impl=transformers runs it through transformers")
    if impl == "native" or (impl is None and native_problem is None):
        return "native", f"{arch} is native (trainjob's own decoder: our kernels and tensor-parallel plans apply)"
    problem = transformers_problem(config)
    if problem:
        raise ConfigError(key, path, problem + ("" if impl else f"; trainjob's own decoder runs "
                                                f"{', '.join(hf.ARCHITECTURES)}"))
    why = "asked for" if impl else (f"{arch} is not native" if arch not in hf.ARCHITECTURES
                                    else f"trainjob's own {arch} cannot run it: {native_problem}")
    return "transformers", f"{arch} runs through transformers' own modeling code ({why})"


def describe(path: str, impl: str) -> str:
    """One line: which code runs directory `path` under `model.impl=impl` (as filled in: chosen or asked for),
    and why."""
    try:
        default, why = choose(path, None)
    except ConfigError:  # only the impl asked for can run it
        default, why = None, ""
    if impl == default:
        return f"model.impl={impl} (chosen from config.json): {why}"
    return f"model.impl={impl} as asked" + (f" (the default would be {default}: {why})" if default else "")


def transformers_settings(path: str, key: str = "model.path") -> dict:
    """The `model.*` values (ModelConfig's fields) of directory `path` for the transformers path: sizes for
    the checks, the memory estimate and the MFU formula, from config.json's common spellings."""
    config = _read(path, key)
    out: dict = {}
    for field, (names, default) in _SETTINGS.items():
        found = next((config[n] for n in names if config.get(n) is not None), None)
        if found is None and default is None:
            raise ConfigError(key, path, f"config.json gives no {' / '.join(names)}, which trainjob reads as "
                              f"model.{field}")
        if found is None:
            found = {"n_heads": out.get("n_heads"), "4 dim": 4 * out.get("dim", 0)}.get(default, default)
        out[field] = found
    params = config.get("rope_parameters") or {}
    if params.get("rope_theta") is not None:
        out["rope_theta"] = params["rope_theta"]
    out["rope_theta"], out["norm_eps"] = float(out["rope_theta"]), float(out["norm_eps"])
    out["tie_embeddings"] = bool(out["tie_embeddings"])
    return out


def read(path: str | None, key: str, impl: str | None = None) -> tuple[str, dict]:
    """(the impl, the model.* values) of directory `path` as `model.impl=impl` runs it; raises ConfigError."""
    chosen, _ = choose(path, impl, key)
    return chosen, (hf.settings(path) if chosen == "native" else transformers_settings(path, key))


def fill_config(model_cfg) -> None:
    """With `model=hf`, choose `model.impl` and set the model.* keys from the directory's config.json (the resolved
    config.yaml then describes the model, and says which code runs it, like any preset's)."""
    if model_cfg.name == "hf":
        keep = bool(model_cfg.get("output_router_logits"))  # asked for on the command line: it stays
        impl, values = read(model_cfg.path, "model.path", model_cfg.get("impl"))
        model_cfg.impl = impl
        for key, value in values.items():
            model_cfg[key] = value
        if keep and "output_router_logits" in model_cfg:
            model_cfg["output_router_logits"] = True


def ships_tp_plan(path: str) -> bool | None:
    """Whether the config class of directory `path`'s model type ships a tensor-parallel plan
    (`base_model_tp_plan`), read from the text of its module; None where that cannot be told here (the ranks
    then look at the class itself)."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        model_type = str(json.load(f).get("model_type", ""))
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin or not model_type:
        return None
    module = model_type.replace("-", "_")
    file = os.path.join(os.path.dirname(spec.origin), "models", module, f"configuration_{module}.py")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return "base_model_tp_plan = {" in f.read()
