"""Expert parallelism (`strategy.ep`, `trainer.parallel.expert_parallel`): the experts split over ranks, tokens sent
to them by all-to-all, train the single process's loss curve (router loss included) on the native mixture and a
Qwen3-MoE and a Mixtral model; with FSDP2 sharding the experts over the other ranks too; an ep=2 checkpoint resumes
at ep=1 and the reverse, and exports a Hugging Face model that transformers loads with the trained model's logits. What
does not divide or compose is refused in one line, before anything runs.

All of it runs real torchrun processes with gloo collectives (all_to_all_single on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY, compose_refused, read_metrics, read_summary
from tests.trainer.hf_models import add_tokenizer, make_family

# Expert parallelism computes each expert's rows in another batch and sums in another order: float32 rounding,
# measured at relative < 2e-7 over ten steps. A wrong expert, a missing 1 / ep or a router loss over one rank's
# rows moves the loss by > 1e-3.
RTOL = 1e-5
DIST = ["+runtime=torch-distributed", "runtime.nproc_per_node=2"]
MOE = [*TINY, "model.n_experts=4", "model.n_experts_per_token=2", "model.output_router_logits=true",
       "model.router_aux_loss_coef=0.01", "train.max_steps=10", "train.eval_every=5", "train.checkpoint_every=5"]


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


def _same_curve(run_dir, reference, first_step: int = 1) -> None:
    """`run_dir`'s losses, router losses and final eval loss are `reference`'s from `first_step` on."""
    metrics, ref = read_metrics(str(run_dir)), read_metrics(str(reference))[first_step - 1:]
    assert [m["step"] for m in metrics] == [m["step"] for m in ref]
    for key in ("loss", "moe/aux_loss", "grad_norm"):
        assert [m[key] for m in metrics] == pytest.approx([m[key] for m in ref], rel=RTOL), key
    assert read_summary(str(run_dir))["final_eval_loss"] == pytest.approx(
        read_summary(str(reference))["final_eval_loss"], rel=RTOL)


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache_dir):
    """The native mixture (4 experts, top 2) trained ten steps in one process, a checkpoint at step 5."""
    from tests.conftest import cli

    run_dir = tmp_path_factory.mktemp("ep") / "single"
    _ok(cli(cache_dir, run_dir.parent, *MOE, f"hydra.run.dir={run_dir}"))
    return run_dir


@pytest.mark.e2e
def test_ep2_trains_the_single_process_curve_and_its_checkpoints_reshard_both_ways(run_cli, tmp_path, single):
    ep2 = tmp_path / "ep2"
    _ok(run_cli(*MOE, *DIST, "strategy=fsdp2_ep", f"hydra.run.dir={ep2}"))
    _same_curve(ep2, single)
    assert read_summary(str(ep2))["world_size"] == 2

    # ep=2's step 5 goes on in one process, and the single process's step 5 under ep=2 (its blocks recomputed in
    # backward, all-to-alls included): the same curve.
    _ok(run_cli(*MOE, f"train.resume={ep2 / 'checkpoints' / 'step-5'}", f"hydra.run.dir={tmp_path / 'to-ep1'}"))
    _same_curve(tmp_path / "to-ep1", single, first_step=6)
    _ok(run_cli(*MOE, *DIST, "strategy=fsdp2_ep", "strategy.activation_checkpointing=full",
                f"train.resume={single / 'checkpoints' / 'step-5'}",
                f"hydra.run.dir={tmp_path / 'to-ep2'}"))
    _same_curve(tmp_path / "to-ep2", single, first_step=6)


@pytest.mark.e2e
@pytest.mark.extended
@pytest.mark.parametrize("ep", [2, 4])
def test_ep_within_fsdp2_over_four_ranks_trains_the_single_process_curve(run_cli, tmp_path, single, ep):
    """dp_shard=4 split into ep x 4 / ep: at ep=2 each expert on two ranks, sharded by FSDP2 between them; at
    ep=4 one expert per rank."""
    run_dir = tmp_path / f"ep{ep}-dp4"
    _ok(run_cli(*MOE, "+runtime=torch-distributed", "runtime.nproc_per_node=4", "strategy=fsdp2_ep",
                f"strategy.ep={ep}", f"hydra.run.dir={run_dir}", timeout=600))
    _same_curve(run_dir, single)


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.extended)])
def test_a_hugging_face_mixture_under_ep2_trains_the_single_process_curve_and_exports_whole(run_cli, tmp_path,
                                                                                            family):
    from transformers import AutoModelForCausalLM

    from trainer import export

    path = add_tokenizer(make_family(str(tmp_path), family))
    args = ["model=hf", f"model.path={path}", "data.seq_len=32",
            "train.global_batch_size=4", "train.max_steps=4", "train.eval_every=4", "train.checkpoint_every=4",
            "train.progress=false", "train.log_every=1", "lr_schedule.warmup_steps=1"]
    _ok(run_cli(*args, f"hydra.run.dir={tmp_path / 'single'}"))
    _ok(run_cli(*args, *DIST, "strategy=fsdp2_ep", f"hydra.run.dir={tmp_path / 'ep2'}"))
    _same_curve(tmp_path / "ep2", tmp_path / "single")

    checkpoint = str(tmp_path / "ep2" / "checkpoints" / "step-4")
    out = export.export(checkpoint, str(tmp_path / "export"))
    ours = export.load_model(checkpoint, export.run_config(checkpoint)).eval()
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-4)


REFUSED = {
    "no experts": ([*DIST, "strategy=fsdp2_ep"], "strategy.ep=2: splits a mixture of experts over ranks; model "
                   "debug has no experts (model.n_experts=0)"),
    "experts do not divide": ([*DIST, "strategy=fsdp2_ep", "model.n_experts=3", "model.n_experts_per_token=1"],
                              "strategy.ep=2: must divide model.n_experts=3"),
    "ep does not divide dp_shard": ([*DIST, "strategy=fsdp2_ep", "strategy.ep=4", "model.n_experts=4",
                                     "model.n_experts_per_token=1"], "strategy.ep=4: must divide strategy.dp_shard=2"),
    "pipeline": (["+runtime=torch-distributed", "runtime.nproc_per_node=4", "strategy=fsdp2_ep", "strategy.pp=2",
                  "model.n_experts=4", "model.n_experts_per_token=1"],
                 "strategy.pp=2: strategy.ep=2 does not compose with pipeline parallelism"),
    "tensor": (["+runtime=torch-distributed", "runtime.nproc_per_node=4", "strategy=fsdp2_ep", "strategy.tp=2",
                "model.n_experts=4", "model.n_experts_per_token=1"],
               "strategy.tp=2: strategy.ep=2 does not compose with tensor parallelism"),
    "ddp": ([*DIST, "strategy=ddp", "strategy.ep=2", "model.n_experts=4", "model.n_experts_per_token=1"],
            "strategy.ep=2: expert parallelism splits the experts over FSDP2's ranks (strategy.dp_shard); "
            "strategy.data_parallel=ddp does not compose with it"),
    "recipe": ([*DIST, "strategy=fsdp2_ep", "model.n_experts=4", "model.n_experts_per_token=1", "recipe=kd",
                "recipe.teacher.path=/nonexistent"],
               "recipe='kd': strategy.ep=2 runs recipes pretrain, sft"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_expert_parallelism_cannot_run_is_refused_in_one_line(tmp_path, capsys, case):
    overrides, message = REFUSED[case]
    err = compose_refused(tmp_path, capsys, *overrides)
    assert message in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run" / "config.yaml").exists()
