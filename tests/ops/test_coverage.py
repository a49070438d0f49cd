"""The kernel coverage of the step `python -m trainer` runs (bench/coverage.py) does not fall: one step of a
one-layer `model=debug` and of a tiny Hugging Face model (`model=hf`), at 8 tokens, built and trained as the
CLI does (checked, run directory claimed, the worker in this process) under Triton's interpreter (or
compiled on a GPU), traced at the ATen level: every op that computes reaches ours under kernels=triton,
none under kernels=torch; and what `kernels.*` routes is what the loop runs under."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench_script import load
from trainer.config.families import BY_NAME

REPO = Path(__file__).resolve().parents[2]
coverage = load("coverage")

ONE_LAYER = ["model=debug", "model.n_layers=1"]
# Ops the step must call, in ours (a trace that lost them would pass the 100% below vacuously): the
# matmuls, the embedding, the loss's arithmetic, the loop's loss sum (add_), clipping's norms and scale.
ROUTED = {"mm", "mm.out", "addmm_", "embedding", "embedding_dense_backward", "add.Tensor", "add_.Tensor",
          "mul.Tensor", "mul_.Tensor", "div.Tensor", "ne.Scalar", "clamp", "reciprocal", "sum", "sum.dim_IntList",
          "_foreach_norm.Scalar", "stack", "linalg_vector_norm", "_foreach_mul_.Tensor"}
# The model's fused modules, clipping and the optimizer launch these.
KERNELS = {"_norm_fwd", "_norm_bwd", "_rope", "_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_pw_TT_o1_r1",
           "_pw_TTT_o2_r1", "_ce_loss", "_ce_grad", "_matmul", "_embedding_fwd", "_embedding_bwd", "_adamw",
           "_sumsq_blocks", "_segment_norms", "_scale_", "_stack"}


@pytest.fixture(scope="module")
def triton_step():
    return coverage.trace_run([*ONE_LAYER, "kernels=triton"], seq=8, batch=1, steps=1)


def _all_ours(cov):
    """Every computing ATen call reached ours: PyTorch only for the excluded kinds (views, allocations, copies)."""
    assert not cov.reasons, f"computing ops left to PyTorch: {cov.reasons}"
    s = cov.summary
    assert s["calls"] > 0 and s["ours_calls"] == s["calls"] and s["ours_bytes"] == s["bytes"], s


@pytest.mark.timeout(400)
@pytest.mark.e2e
def test_the_cli_step_runs_in_our_kernels(triton_step):
    cov = triton_step
    ours = {name for name, row in cov.rows.items() if not row.kind and row.ours}
    assert ours >= ROUTED, f"back to PyTorch: {sorted(ROUTED - ours)}"
    _all_ours(cov)
    assert set(cov.launches) >= KERNELS, f"not launched: {sorted(KERNELS - set(cov.launches))}"
    # ops.AdamW: one launch per param group (with decay, without), the whole model in two.
    assert cov.launches["_adamw"] == 2
    assert cov.rows["view"].kind == "view" and cov.rows["view"].bytes == 0
    assert cov.rows["mm"].calls >= 7 * 3 and cov.rows["mm"].bytes > 0  # seven linears, forward and backward
    text = coverage.table(cov)
    s = cov.summary
    assert f"computing ATen calls in ours: {s['calls']} of {s['calls']} (100.0%)" in text, text
    assert "left to PyTorch: none" in text and "excluded: allocation" in text and "_attn_fwd" in text


@pytest.mark.timeout(120)
def test_under_kernels_torch_every_op_is_left_to_pytorch_with_its_reason():
    cov = coverage.trace_run([*ONE_LAYER, "kernels=torch"], seq=8, batch=1, steps=1)
    assert cov.summary["ours_calls"] == 0 and cov.summary["calls"] > 0 and not cov.launches
    # torch's foreach AdamW and clipping, and the matmuls: each listed with the reason.
    assert {"mm", "_foreach_norm.Scalar", "_foreach_lerp_.Scalar"} <= set(cov.reasons)
    assert set(cov.reasons.values()) == {"kernels=torch: PyTorch's kernels throughout"}
    left = next(line for line in coverage.table(cov).splitlines() if line.startswith("left to PyTorch: "))
    ops_left = left.removeprefix("left to PyTorch: ").split(" (")[0].split(", ")  # one reason: one group
    assert {"mm", "_foreach_norm.Scalar"} <= set(ops_left)
    assert left.endswith("(kernels=torch: PyTorch's kernels throughout)")
    assert "torch: kernels=torch: PyTorch's kernels throughout" in coverage.table(cov)  # each op's row


@pytest.mark.timeout(400)
def test_a_hugging_face_models_cli_step_runs_in_our_kernels(tmp_path):
    """model=hf shapes: a tiny Qwen2 directory (q/k/v biases: addmm; tied embeddings)."""
    cov = coverage.trace_run([*coverage.family_overrides("qwen2", str(tmp_path)), "kernels=triton"], seq=8,
                             batch=1, steps=1)
    _all_ours(cov)
    assert cov.rows["addmm"].ours == 2 * 3  # q, k, v of two layers
    assert "_attn_bwd_dq" in cov.launches


def test_the_loop_routes_what_the_kernels_section_names_and_releases_it():
    """`kernels.exclude=[mm,addmm,bmm]` keeps cuBLAS's matmuls; kernels.aten=false and kernels=torch route no
    ATen op; after the block nothing stays routed."""
    import ops
    from trainer.models.kernels import Kernels

    exclude = coverage.compose(["kernels=triton", "kernels.exclude=[mm,addmm,bmm]"]).kernels
    with Kernels.of(exclude).routing():
        routed = set(ops.registered())
    assert routed and not routed & {"mm", "mm.out", "addmm", "addmm_", "bmm"} and "embedding" in routed
    assert ops.registered() == []
    only = coverage.compose(["kernels=triton", "kernels.include=[rms_norm,mm,_softmax]"]).kernels
    with Kernels.of(only).routing():
        assert set(ops.registered()) == {"mm", "mm.out", "_softmax"}
    for overrides in (["kernels=triton", "kernels.aten=false"], ["kernels=torch"],
                      ["kernels=triton", "kernels.include=[rms_norm]"]):
        with Kernels.of(coverage.compose(overrides).kernels).routing():
            assert ops.registered() == [], overrides


def test_the_routing_is_built_from_the_table_the_config_reads():
    """ops.aten routes exactly the overloads of ops.aten_routes, the table trainer/config (no torch) checks
    kernels.include/exclude against, and reading that table loads neither torch nor triton."""
    import subprocess
    import sys

    from ops.aten import OPS
    from ops.aten_routes import NAMES, TABLE

    assert list(OPS) == [aten for _, aten in TABLE] and set(NAMES) >= set(OPS)
    probe = ("import sys, ops, trainer.config.kernels; "
             "print(' '.join(m for m in sys.modules if m in ('torch', 'triton') or m.startswith('ops')))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True,
                            timeout=60).stdout.split()
    assert loaded == ["ops", "ops.aten_routes"]


def test_coverage_refuses_bad_arguments_before_any_work(capsys):
    """As its command line runs it: exit 2 and one line."""
    for argv, message in ((["--seq", "0"], "--seq 0 --batch 2 --steps 1: each must be at least 1"),
                          (["--families", "gpt"], "--families gpt: each one of debug, llama, qwen2")):
        with pytest.raises(SystemExit) as exit_:
            coverage.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def _rows(text: str) -> dict[tuple[str, str, str], tuple[float | None, str]]:
    """The closing table coverage.main prints: (family, impl, recipe) -> (share or None when refused, the rest)."""
    lines = text.splitlines()
    out = {}
    for line in lines[lines.index(coverage.HEADER) + 1:-1]:
        family, impl, recipe, _kernels, calls, share, rest = line.split(maxsplit=6)
        out[family, impl, recipe] = (None if calls == "-" else float(share.rstrip("%")) / 100, rest)
    return out


# What `python -m trainer` refuses among the rows (under kernels=torch too), and the words it says why: the
# recipes' losses from hidden states would skip the logits' soft-capping or scaling after the output layer.
TRANSFORMED = "transforms its logits"
REFUSED = {("gemma2", "native", "kd"): "without the soft-capping of the model's final logits",
           **{(family, "transformers", recipe): TRANSFORMED for family in ("gemma2", "granite")
              for recipe in ("dpo", "grpo", "kd")}}


@pytest.mark.timeout(600)
def test_grpos_step_and_its_generation_run_in_our_kernels(tmp_path):
    """The plain suite's share of the table below: GRPO's step and its rollout (the generation row) on Qwen3."""
    rows = coverage.measure("qwen3", "native", "grpo", str(tmp_path), seq=8)
    assert [r.recipe for r in rows] == ["grpo", "generation"]
    for row in rows:
        assert not row.refused and coverage.summary(row.rows)["calls"] > 0 and row.share >= coverage.FLOOR, \
            row.line()


@pytest.mark.matrix  # neither pytest nor CI's e2e step: 12 families x 12 rows, 31 min under the interpreter here
@pytest.mark.timeout(2400)  # ten runs under the interpreter: 5 to 20 minutes on two busy cores
@pytest.mark.parametrize("family", sorted(BY_NAME))
def test_every_recipe_and_generation_of_each_family_runs_in_our_kernels(family, capsys):
    """bench/coverage.py's table for one family of trainer/config/families.py: a row per model.impl x recipe and the
    generation row (GRPO's rollout), each with at least 95% of its computing ATen calls in ours, or refused by
    `python -m trainer` in one line where the table above says so."""
    coverage.main(["--families", family, "--quiet"])
    rows = _rows(capsys.readouterr().out)
    expected = {(family, i, r) for i in coverage.IMPLS for r in coverage.RECIPES}
    expected |= {(family, i, "generation") for i in coverage.IMPLS if (family, i, "grpo") not in REFUSED}
    assert set(rows) == expected
    for key, (share, rest) in rows.items():
        if key in REFUSED:
            assert share is None and REFUSED[key] in rest, (key, rest)
        else:
            assert share is not None and share >= coverage.FLOOR, (key, share, rest)
