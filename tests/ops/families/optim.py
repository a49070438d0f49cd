"""The op tests of the fused AdamW step."""

from __future__ import annotations

import copy

import pytest
import torch

import ops
from tests.ops.conftest import DEVICE
from tests.ops.families.common import _leaf, _tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adamw_steps_as_torch_does(dtype):
    """Three steps of ours against torch.optim.AdamW on float64 copies of the same parameters and grads."""
    params = [_leaf(37, 5, dtype=dtype), _leaf(1100, dtype=dtype), _leaf(1, dtype=dtype)]
    refs = [p.detach().double().requires_grad_() for p in params]
    kwargs = {"lr": 0.1, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    ours, ref = ops.AdamW(params, **kwargs), torch.optim.AdamW(refs, **kwargs)
    for _ in range(3):
        for p, r in zip(params, refs, strict=True):
            g = torch.randn(p.shape, dtype=torch.float64, device=DEVICE)
            p.grad, r.grad = g.to(dtype), g.to(dtype).double()
        ours.step()
        ref.step()
    atol, rtol = _tolerance(dtype)
    for p, r in zip(params, refs, strict=True):
        torch.testing.assert_close(p.detach().double(), r.detach(), atol=atol, rtol=rtol)
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"].double(), ref.state[r]["exp_avg_sq"], atol=atol,
                                   rtol=rtol)
    assert ours.state[params[0]]["step"] == 3
    with pytest.raises(ValueError, match=r"betas=\(1.0, 0.9\): each must be in \[0, 1\)"):
        ops.AdamW(params, betas=(1.0, 0.9))


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=DEVICE, dtype=p.dtype) for p in params]


def test_adamw_groups_tensors_and_its_state_dict_loads_both_ways(monkeypatch):
    """Two param groups (weight decay and none) with fp32 and bf16 parameters: one launch per group, dtype and
    step; `maximize` as torch's. Its state dict has torch's keys (param groups included: DCP loads key by key)
    and loads into torch.optim.AdamW, and torch's into ours, each then stepping as the other would."""
    import ops.optim

    def make():
        torch.manual_seed(3)
        return [_leaf(7, 5), _leaf(300), _leaf(4, 4, dtype=torch.bfloat16), _leaf(5)]

    def build(cls, params, **kw):
        return cls([{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}],
                   lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=True, **kw)

    launches = []
    launch = ops.optim._launch
    monkeypatch.setattr(ops.optim, "_launch", lambda *a, **k: (launches.append(a[0][0].dtype), launch(*a, **k)))
    for maximize in (False, True):
        mine, ref = make(), make()
        ours, theirs = build(ops.AdamW, mine, maximize=maximize), build(torch.optim.AdamW, ref, maximize=maximize)
        for step in range(2):
            for p, r, g in zip(mine, ref, _grads(mine, step), strict=True):
                p.grad, r.grad = g.clone(), g.clone()
            ours.step()
            theirs.step()
        for p, r in zip(mine, ref, strict=True):
            torch.testing.assert_close(p, r, **dict(zip(("atol", "rtol"), _tolerance(p.dtype), strict=True)))
    assert launches == [torch.float32, torch.bfloat16, torch.float32] * 4
    saved, saved_ref = ours.state_dict(), theirs.state_dict()
    assert saved["param_groups"] == saved_ref["param_groups"]
    assert {k: type(v) for k, v in saved["state"][0].items()} == {k: type(v) for k, v in saved_ref["state"][0].items()}
    assert saved["state"][0]["step"].item() == 2 and ours.state[mine[0]]["step"] == 2  # a plain count inside
    # Ours loads torch's state and torch loads ours: the next step agrees with the one the original takes.
    for src, dst_cls in ((theirs, ops.AdamW), (ours, torch.optim.AdamW)):
        params = [p.detach().clone().requires_grad_() for p in (ref if src is theirs else mine)]
        dst = build(dst_cls, params)
        dst.load_state_dict(copy.deepcopy(src.state_dict()))  # not the tensors src goes on updating
        grads = _grads(params, 9)
        for p, q, g in zip(params, src.param_groups[0]["params"] + src.param_groups[1]["params"], grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        dst.step()
        src.step()
        for p, q in zip(params, src.param_groups[0]["params"] + src.param_groups[1]["params"], strict=True):
            torch.testing.assert_close(p, q, **dict(zip(("atol", "rtol"), _tolerance(p.dtype), strict=True)))
    with pytest.raises(ValueError, match="amsgrad=True: ops.AdamW is the plain"):
        ops.AdamW(mine, amsgrad=True)


def test_adamw_steps_dtensor_parameters_by_their_local_shards():
    """FSDP2's parameters are DTensors: ours steps each rank's shard, and keeps DTensor moments as torch does
    (a sharded checkpoint holds them as torch's). On a one-rank mesh here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(DEVICE, (1,))
        full = [torch.randn(6, 4, device=DEVICE), torch.randn(9, device=DEVICE)]
        mine = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
        ref = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
        ours, theirs = ops.AdamW(mine, lr=0.05, weight_decay=0.1), torch.optim.AdamW(ref, lr=0.05, weight_decay=0.1)
        for step in range(2):
            for p, r, g in zip(mine, ref, _grads(full, step), strict=True):
                p.grad = distribute_tensor(g.float(), mesh, [Shard(0)])
                r.grad = distribute_tensor(g.float(), mesh, [Shard(0)])
            ours.step()
            theirs.step()
        for p, r in zip(mine, ref, strict=True):
            torch.testing.assert_close(p.full_tensor(), r.full_tensor(), atol=1e-6, rtol=1e-5)
            assert isinstance(ours.state[p]["exp_avg"], DTensor)
    finally:
        if own:
            dist.destroy_process_group()
