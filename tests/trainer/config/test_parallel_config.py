"""Strategies are presets of degrees: `fsdp2_tp` builds on `fsdp2`, a new combination is a yaml file, the
degrees are checked and filled in one place (`ParallelDims`), `parallelize` applies what they ask for, and
the worker trains from typed dataclasses."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import FSDPModule

from launchers import SchedulerConfig
from launchers.local.options import LocalLauncherConfig
from tests.conftest import compose_run, examples
from trainer import config, models
from trainer.config.compose import compose
from trainer.config.validate import validate
from trainer.parallel import ParallelDims, parallelize
from trainjob.run_files import RunDir


def _compose(*overrides: str):
    cfg = compose(overrides)
    cfg.run_dir = "/nonexistent/run"
    return cfg


@pytest.mark.timeout(60)
def test_fsdp2_tp_is_fsdp2_with_a_tensor_parallel_degree():
    fsdp2 = asdict(validate(_compose("strategy=fsdp2")).job.strategy)
    dist2 = ["+runtime=torch-distributed", "runtime.nproc_per_node=2"]
    fsdp2_tp = asdict(validate(_compose("strategy=fsdp2_tp", *dist2)).job.strategy)
    assert {k: v for k, v in fsdp2_tp.items() if fsdp2[k] != v} == {"name": "fsdp2_tp", "tp": 2}


@pytest.mark.timeout(60)
def test_a_new_combination_is_a_yaml_file(tmp_path):
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "hsdp_tp.yaml").write_text(
        "defaults:\n  - fsdp2\n  - _self_\nname: hsdp_tp\ndp_replicate: 2\ntp: 2\n"
    )
    cfg = _compose(
        f"hydra.searchpath=[file://{tmp_path}]",
        "strategy=hsdp_tp",
        "+runtime=torch-distributed",
        "runtime.nproc_per_node=8",
    )
    job, shape = validate(cfg)
    assert job.strategy.name == "hsdp_tp" and shape.world == 8 and shape.counts == range(1, 2)
    dims = shape.dims
    assert dims.degrees() == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert dims.fsdp and not dims.ddp and dims.dp_size == 4
    with pytest.raises(config.ConfigError, match="strategy='hsdp_tp': strategy=hsdp_tp needs more than one process"):
        validate(_compose(f"hydra.searchpath=[file://{tmp_path}]", "strategy=hsdp_tp"))


@pytest.mark.timeout(120)
@settings(max_examples=examples(200))
@given(
    degrees=st.lists(st.sampled_from([-2, -1, 0, 1, 2, 3, 4, 8]), min_size=3, max_size=3),
    world=st.integers(1, 64),
)
def test_degrees_are_filled_to_the_world_or_refused_naming_the_key(degrees, world):
    try:
        dims = ParallelDims(*degrees, world_size=world)
    except config.ConfigError as e:
        assert str(e).startswith("invalid config: strategy") and "\n" not in str(e)
        return
    filled = dims.degrees()
    assert dims.dp_replicate * dims.dp_shard * dims.tp == world and min(filled.values()) >= 1
    assert filled["pp"] == 1
    assert [filled[n] for n, given in zip(("dp_replicate", "dp_shard", "tp"), degrees, strict=True) if given != -1] == [
        g for g in degrees if g != -1
    ]


@pytest.mark.timeout(30)
def test_each_section_checks_its_own_fields():
    # The fields a section declares positive are checked by validate(), before the section's own check().
    assert {"lr", "eps"} <= set(config.OptimConfig.POSITIVE)
    with pytest.raises(config.ConfigError, match=r"optim.eps=-1.0: must be > 0"):
        validate(_compose("optim.eps=-1"))
    with pytest.raises(config.ConfigError, match=r"optim.momentum=-1.0: must be >= 0"):
        config.OptimConfig(name="adamw", momentum=-1.0).check()
    with pytest.raises(config.ConfigError, match=r"strategy.tp=2: strategy=mine uses only strategy.dp_replicate"):
        config.StrategyConfig(name="mine", data_parallel="ddp", tp=2).check()
    config.StrategyConfig(name="mine", tp=2).check()  # fsdp composes with tp
    with pytest.raises(config.ConfigError, match=r"strategy.data_parallel='zero': must be one of fsdp, ddp"):
        config.StrategyConfig(name="mine", data_parallel="zero").check()


@pytest.mark.timeout(60)
def test_the_worker_reads_the_saved_config_as_dataclasses(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("TRAINJOB_CACHE", cache_dir)
    run = compose_run(tmp_path, "train.max_steps=1")
    assert run.spec.config_path == RunDir.of(run.spec.run_dir).config
    job = config.typed(OmegaConf.load(run.spec.config_path))
    assert isinstance(job, config.Config) and isinstance(job.data.cache, config.CacheConfig)
    assert job.train.max_steps == 1 and job.run_dir == run.spec.run_dir
    # The launcher's and scheduler's sections stay the nodes they were (a rank reads no launcher schema), with
    # the values the driver's typed config holds.
    assert isinstance(job.launcher, DictConfig) and isinstance(job.scheduler, DictConfig)
    driver = validate(OmegaConf.load(run.spec.config_path)).job
    assert isinstance(driver.launcher, LocalLauncherConfig) and isinstance(driver.scheduler, SchedulerConfig)
    assert dict(job.launcher) == asdict(driver.launcher) and dict(job.scheduler) == asdict(driver.scheduler)


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _parallelized(preset: str, *overrides: str):
    job, shape = validate(_compose(f"strategy={preset}", "model.dim=64", "model.n_layers=2", *overrides))
    dims = ParallelDims.from_config(job.strategy, shape.world)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = models.build(job.model)
    return parallelize(model, dims, job.strategy)


@pytest.mark.timeout(60)
def test_parallelize_applies_what_the_degrees_ask_for_on_one_rank(one_rank_group):
    plain = _parallelized("ddp")
    assert type(plain).__name__ == "Transformer" and plain.output.weight.device.type == "cpu"
    assert not isinstance(_parallelized("fsdp2"), FSDPModule)  # one data-parallel rank: nothing to shard
    wrapped = _parallelized("fsdp2", "strategy.activation_checkpointing=full")
    assert all(type(b).__name__ == "CheckpointWrapper" for b in wrapped.layers.values())
