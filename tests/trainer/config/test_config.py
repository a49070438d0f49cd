"""The config groups compose, and a config that cannot run is refused with a clear error and exit 2."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

import launchers
from tests.conftest import REPO
from trainer import config
from trainer.config.compose import compose, plain_group_overrides
from trainer.config.hf_impl import fill_config
from trainer.config.validate import validate
from trainjob import runtimes

CONF = os.path.join(REPO, "conf")


def _options(group: str) -> list[str]:
    return sorted(f[:-5] for f in os.listdir(os.path.join(CONF, group)) if f.endswith(".yaml"))


def _compose(overrides: list[str]):
    cfg = compose(overrides)
    cfg.run_dir = "/nonexistent/run"
    return cfg


def test_runtime_is_an_optional_group_chosen_plainly_or_with_a_plus_as_before():
    """conf/config.yaml declares `runtime: null`: no runtime unless asked, `runtime=torch-distributed` as for
    every group, and `+runtime=`, the spelling before, the same config."""
    assert _compose([]).runtime is None
    plain, plus = (_compose([f"{p}runtime=torch-distributed", "runtime.nproc_per_node=2"]) for p in ("", "+"))
    assert plain.runtime.name == "torch-distributed" and plain.runtime.nproc_per_node == 2
    assert OmegaConf.to_container(plain) == OmegaConf.to_container(plus)
    assert plain_group_overrides(["+runtime=x", "+train.foo=1", "runtime.nnodes=2"]) == [
        "runtime=x", "+train.foo=1", "runtime.nnodes=2"]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> str:
    from tests.trainer.hf_models import add_tokenizer, make_llama

    return add_tokenizer(make_llama(str(tmp_path_factory.mktemp("hf"))))


@pytest.mark.parametrize("group", ["model", "data", "strategy", "runtime", "launcher", "scheduler",
                                   "kernels", "optim", "train", "recipe"])
def test_every_option_of_every_group_composes_and_validates(group, monkeypatch, hf_model):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels=triton runs here only under the interpreter
    for option in _options(group):
        distributed = ["runtime=torch-distributed", "runtime.nproc_per_node=2"]
        chat = ["model=hf", f"model.path={hf_model}", "data=chat", "recipe=sft", "data.path=/tmp/chats.jsonl"]
        pairs = ["model=hf", f"model.path={hf_model}", "data=preference", "recipe=dpo", "data.path=/tmp/pairs.jsonl"]
        prompts = ["data=prompts", "recipe=grpo", "data.path=/tmp/prompts.jsonl",
                   "recipe.reward_funcs=[trainer.rewards.shipped:contains_answer]"]
        extra = {("data", "parquet"): ["data.path=/tmp"],
                 ("model", "hf"): [f"model.path={hf_model}"],
                 ("data", "chat"): chat,
                 ("recipe", "sft"): chat,
                 ("data", "preference"): [*pairs],
                 ("recipe", "dpo"): [*pairs],
                 ("recipe", "kto"): [o.replace("recipe=dpo", "recipe=kto") for o in pairs],
                 ("recipe", "grpo"): prompts,
                 ("recipe", "rloo"): [o.replace("recipe=grpo", "recipe=rloo") for o in prompts],
                 ("recipe", "ppo"): [o.replace("recipe=grpo", "recipe=ppo") for o in prompts],
                 ("recipe", "reward"): [o.replace("recipe=dpo", "recipe=reward") for o in pairs],
                 ("data", "prompts"): prompts,
                 ("recipe", "kd"): ["model=hf", f"model.path={hf_model}", f"recipe.teacher.path={hf_model}"],
                 ("strategy", "tp"): distributed,
                 ("strategy", "fsdp2_tp"): distributed,
                 ("strategy", "pp"): distributed,
                 ("strategy", "fsdp2_pp"): distributed,
                 ("strategy", "fsdp2_ep"): [*distributed, "model.n_experts=4", "model.n_experts_per_token=2"],
                 ("strategy", "fsdp2_cp"): distributed,
                 ("strategy", "deepspeed"): ["runtime=deepspeed-distributed", "runtime.nproc_per_node=2"],
                 ("runtime", "deepspeed-distributed"): ["strategy=deepspeed"],
                 ("launcher", "docker"): distributed,
                 ("launcher", "kubernetes"): distributed,
                 }.get((group, option), [])
        if group == "scheduler" and option != "none":
            extra = ["launcher=kubernetes", *distributed]
        cfg = _compose([f"{group}={option}", *extra])
        if cfg.model.name == "hf":  # the driver reads the model.* keys from the directory's config.json
            fill_config(cfg.model)
        if group != "train":
            assert OmegaConf.select(cfg, f"{group}.name") == option
        if group == "runtime" and runtimes.get(option).function_only:  # runs functions (Client.train) only
            with pytest.raises(config.ConfigError, match=f"runtime='{option}': runs a user's function"):
                validate(cfg)
            continue
        validate(cfg)


def test_runtime_is_not_in_the_defaults():
    assert _compose([]).runtime is None


def test_world_size_follows_the_runtime():
    local = launchers.offers({"name": "local"})
    assert config.job_shape(_compose([]), local).world == 1
    cfg = _compose(["+runtime=torch-distributed", "runtime.nproc_per_node=3", "runtime.nnodes=2",
                    "runtime.rdzv_endpoint=node0:29400", "train.global_batch_size=12"])
    assert config.job_shape(cfg, local).world == 6
    assert validate(cfg).shape == config.job_shape(cfg, local)


def test_triton_kernels_need_a_gpu_or_the_interpreter_and_no_dtensors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(config.ConfigError, match="kernels='triton': needs a CUDA GPU, or TRITON_INTERPRET=1"):
        validate(_compose(["kernels=triton"]))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate(_compose(["kernels=triton", "kernels.exclude=[fused_linear_cross_entropy]"]))
    with pytest.raises(config.ConfigError, match="strategy=tp hands the kernels DTensors"):
        validate(_compose(["kernels=triton", "strategy=tp", "+runtime=torch-distributed"]))
    validate(_compose(["kernels=triton", "kernels.include=[softmax,rms_norm]", "kernels.exclude=[mm.out]"]))


def test_kernels_names_are_the_models_ops_and_the_aten_ops_in_one_line(monkeypatch):
    """kernels.include / kernels.exclude name the model's fused ops and the ATen ops; an unknown name is one
    line listing both; ATen ops included with kernels.aten=false are refused; optim.impl=triton is AdamW's."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(config.ConfigError) as error:
        validate(_compose(["kernels=triton", "kernels.exclude=[mm,matmul]"]))
    message = str(error.value)
    assert "\n" not in message and "kernels.exclude=['mm', 'matmul']: matmul unknown" in message
    assert "the model's ops are rms_norm, rotary_embedding" in message
    assert "ATen ops (kernels.aten=true) are the " in message and "`python -m ops list` prints" in message
    assert "mm.out" in message  # the overloads are named too
    with pytest.raises(config.ConfigError,
                       match=r"kernels.include=\['mm'\]: mm: ATen ops, routed only with kernels.aten=true"):
        validate(_compose(["kernels=triton", "kernels.aten=false", "kernels.include=[mm]"]))
    with pytest.raises(config.ConfigError,
                       match="optim.impl='triton': ops has AdamW only: optim=sgd takes optim.impl=torch"):
        validate(_compose(["optim=sgd", "optim.impl=triton"]))
    with pytest.raises(config.ConfigError, match="optim.impl='cuda': must be one of torch, triton"):
        validate(_compose(["optim.impl=cuda"]))
    validate(_compose(["kernels=torch", "optim.impl=triton"]))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(config.ConfigError, match="optim.impl='triton': needs a CUDA GPU, or TRITON_INTERPRET=1"):
        validate(_compose(["optim.impl=triton"]))


def test_optim_impl_follows_the_kernels_unless_given():
    from trainer.models.kernels import Kernels

    for overrides, impl in ((["kernels=triton"], "triton"), (["kernels=torch"], "torch"),
                            (["kernels=triton", "optim=sgd"], "torch"),
                            (["kernels=triton", "optim.impl=torch"], "torch"),
                            (["kernels=torch", "optim.impl=triton"], "triton")):
        cfg = _compose(overrides)
        assert Kernels.of(cfg.kernels, cfg.optim).optimizer == impl, overrides


def test_tensor_parallel_peers_share_batches():
    cfg = _compose(["+runtime=torch-distributed", "runtime.nproc_per_node=4", "strategy=fsdp2_tp",
                    "train.global_batch_size=6"])
    shape = validate(cfg).shape
    assert config.mesh_degrees(cfg.strategy, 4) == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert shape.dims.dp_size == 2


BAD = [
    (["optim.lr=0"], "optim.lr=0.0: must be > 0"),
    (["optim.lr=-1e-3"], "optim.lr=-0.001: must be > 0"),
    (["train.global_batch_size=10", "train.grad_accum_steps=4"],
     "train.global_batch_size=10: must be divisible by data-parallel size x train.grad_accum_steps = 1 x 4 = 4"),
    (["+runtime=torch-distributed", "runtime.nproc_per_node=2", "train.global_batch_size=6",
      "train.grad_accum_steps=2"],
     "train.global_batch_size=6: must be divisible by data-parallel size x train.grad_accum_steps = 2 x 2 = 4"),
    (["model.n_kv_heads=3"], "model.n_kv_heads=3: must divide model.n_heads=4"),
    (["data.seq_len=4096"], "data.seq_len=4096: must be <= model.max_seq_len=2048"),
    (["+runtime=torch-distributed", "runtime.nnodes=2"],
     "runtime.rdzv_endpoint=None: must be host:port of node 0 when runtime.nnodes > 1"),
    (["train.mixed_precision=fp8"], "train.mixed_precision='fp8': must be one of auto, fp32, bf16"),
    (["train.allocator=jemalloc"], "train.allocator='jemalloc': must be one of auto, adaptive, release"),
    (["data=parquet"], "data.path=None: data=parquet needs the Parquet files"),
    (["strategy=tp"], "strategy='tp': strategy=tp needs more than one process: add runtime=torch-distributed"),
    (["strategy=fsdp2_tp"], "strategy='fsdp2_tp': strategy=fsdp2_tp needs more than one process"),
    (["+runtime=torch-distributed", "runtime.nproc_per_node=4", "strategy=fsdp2", "strategy.dp_replicate=3"],
     "strategy.dp_shard=-1: the other degrees multiply to 3, which does not divide the world size 4"),
    (["+runtime=torch-distributed", "runtime.nproc_per_node=4", "strategy=fsdp2", "strategy.dp_shard=3"],
     "dp_replicate x dp_shard x cp x tp = 3 must equal the world size 4"),
    (["+runtime=torch-distributed", "runtime.nproc_per_node=2", "strategy=ddp", "strategy.tp=2"],
     "strategy.tp=2: strategy=ddp uses only strategy.dp_replicate; this must be 1"),
    (["+runtime=torch-distributed", "runtime.nproc_per_node=2", "strategy=tp", "model.n_kv_heads=1"],
     "model.n_kv_heads=1: must be divisible by the tensor-parallel degree strategy.tp=2"),
    (["+runtime=torch-distributed", "runtime.nproc_per_node=3", "strategy=tp", "train.global_batch_size=12"],
     "model.n_heads=4: must be divisible by the tensor-parallel degree strategy.tp=3"),
    (["+runtime=torch-distributed", "runtime.nproc_per_node=4", "strategy=fsdp2_tp", "train.global_batch_size=5"],
     "train.global_batch_size=5: must be divisible by data-parallel size x train.grad_accum_steps = 2 x 1 = 2"),
    (["strategy.activation_checkpointing=some"],
     "strategy.activation_checkpointing='some': must be one of none, full, selective"),
    (["data.cache.prefetch=-1"], "data.cache.prefetch=-1: must be >= 0 (0: no read-ahead thread)"),
    (["data.cache.readers=0"],
     "data.cache.readers=0: must be 1 to 64 (read-ahead threads, each with a connection to every node)"),
    (["data.cache.readers=65"], "data.cache.readers=65: must be 1 to 64"),
    (["data.cache.eval_endpoints=[http://node:50051]"],
     "data.cache.eval_endpoints[0]='http://node:50051': must be a Flight location such as grpc://host:50051"),
    (["recipe.loss_type=dapo"],
     "recipe.loss_type='dapo': only recipe=grpo, recipe=dpo and recipe=kto read it (recipe=pretrain"),
    (["recipe.importance_sampling_level=sequence"],
     "recipe.importance_sampling_level='sequence': only recipe=grpo reads it"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_rule_names_key_value_and_what_is_allowed(overrides, message):
    with pytest.raises(config.ConfigError) as info:
        validate(_compose(overrides))
    assert message in str(info.value)


CLI_BAD = [
    (["optim.lr=0"], "invalid config: optim.lr=0.0: must be > 0"),
    (["optim.lr=abc"], "Value 'abc' of type 'str' could not be converted to Float"),
    (["optim.foo=1"], "invalid config: optim.foo=1: optim has no key foo; optim has betas, eps, grad_clip"),
    (["+optim.foo=1"], "invalid config: optim.foo=1: optim has no key foo; optim has betas, eps, grad_clip"),
    (["strategy=nope"], "invalid config: strategy='nope': no such option; strategy has ddp, deepspeed, fsdp2"),
    (["train.global_batch_size=10", "train.grad_accum_steps=4"], "must be divisible by data-parallel size"),
    (["strategy=tp"], "strategy=tp needs more than one process"),
]


@pytest.fixture(scope="module")
def cli_bad(run_cli_batch, tmp_path_factory) -> list:
    """Each CLI_BAD row run by the CLI in a directory of its own, all from one interpreter: (process, directory)."""
    dirs = [tmp_path_factory.mktemp("cli-bad") for _ in CLI_BAD]
    procs = run_cli_batch([(overrides, d) for (overrides, _), d in zip(CLI_BAD, dirs, strict=True)])
    return list(zip(procs, dirs, strict=True))


@pytest.mark.parametrize("row", range(len(CLI_BAD)), ids=[" ".join(o) for o, _ in CLI_BAD])
def test_cli_refuses_bad_config_with_exit_2_and_no_run_dir(cli_bad, row):
    (proc, tmp_path), (_, message) = cli_bad[row], CLI_BAD[row]
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "outputs").exists(), list((tmp_path / "outputs").rglob("*"))


def test_cli_keeps_an_existing_run_dir_when_refusing(run_cli, tmp_path):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("keep me")
    proc = run_cli("optim.lr=0", f"hydra.run.dir={run_dir}", timeout=120)
    assert proc.returncode == 2
    assert (run_dir / "notes.txt").read_text() == "keep me"


def test_help_introduces_trainjob_and_lists_only_options_a_user_can_choose(run_cli):
    proc = run_cli("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("trainjob: declarative PyTorch training")
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "launcher: docker, kubernetes, local\n" in groups and "schema" not in groups


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_preset_composes_and_validates_given_its_paths(experiment, hf_model, tmp_path):
    # The tiny test model holds 256 positions; the presets ask for the real models' 1024-2048.
    if experiment.startswith("phi3"):  # its LoRA targets are Phi-3's fused layers
        from tests.trainer.hf_models import make_family

        hf_model = make_family(str(tmp_path), "phi3")
    cfg = _compose([f"+experiment={experiment}", f"model.path={hf_model}", "data.path=/tmp/rows.jsonl",
                    "data.seq_len=64", *([f"recipe.teacher.path={hf_model}"] if "_kd" in experiment else []),
                    *(["recipe.max_completion_length=64"] if experiment.endswith(("_grpo", "_ppo")) else [])])
    fill_config(cfg.model)
    validate(cfg)
    assert cfg.model.name == "hf" and cfg.strategy.name == "fsdp2"
    assert cfg.recipe.name in ("sft", "dpo", "grpo", "kd", "ppo")
    with pytest.raises(config.ConfigError, match="model.path=None: model=hf needs a Hugging Face model directory"):
        fill_config(_compose([f"+experiment={experiment}"]).model)
