"""The random ops: one Triton kernel (`_random`: Philox uniform or normal numbers) and the ops composed of it and
of the generated pointwise kernels: uniform_, normal_, exponential_, bernoulli_, multinomial and native_dropout
(with its backward).

They keep PyTorch's contract on generators: each call takes its numbers from the `generator=` it is given, or
else the default generator of the tensor's device, and advances it, so that `torch.manual_seed(s)` (or
`Generator.manual_seed`) makes every later draw reproducible and two draws differ. A CUDA generator is read
as FlagGems reads it (its Philox seed and offset, the offset advanced by the numbers drawn, rounded up to 4);
a CPU generator (MT19937, under the interpreter) gives the call's Philox seed by drawing one number from it.
`ATEN` holds the functions of the ATen overloads it routes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ops import pointwise_ops, reductions
from ops.indexing import cat, put
from ops.pointwise_ops import OPS
from ops.settings import POINTWISE_BLOCK, warps

_SEEDS = (2**31, 2**62)  # a CPU generator's draw of a seed: always an int64 argument, as a GPU's seed is


@triton.jit
def _random(out_ptr, n, seed, offset, a, b, NORMAL: tl.constexpr, BLOCK: tl.constexpr):
    """Uniform in [a, b), or normal with mean a and standard deviation b: Philox numbers offset .. offset + n."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = a + b * tl.randn(seed, offset + offs) if NORMAL else a + (b - a) * tl.rand(seed, offset + offs)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=offs < n)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def philox_seed_offset(count: int, device: torch.device, generator: torch.Generator | None = None) -> tuple[int, int]:
    """The Philox (seed, offset) of the next `count` numbers of `generator` (or `device`'s default one), which
    is advanced past them."""
    gen = generator if generator is not None else _default_generator(device)
    if gen.device.type == "cuda":
        state = gen.get_state()
        words = state.view(torch.int64)
        seed, offset = int(words[0]), int(words[1])
        words[1] += (count + 3) // 4 * 4
        gen.set_state(state)
        return seed, offset
    return int(torch.randint(*_SEEDS, (), generator=gen, dtype=torch.int64)), 0


def random_(self: torch.Tensor, a: float, b: float, normal: bool, generator=None) -> torch.Tensor:
    """Fill `self` with uniform numbers in [a, b) or normal ones (mean a, std b), from `generator`."""
    target = self if self.is_contiguous() else torch.empty_like(self, memory_format=torch.contiguous_format)
    n = target.numel()
    if n:
        seed, offset = philox_seed_offset(n, self.device, generator)
        _random[(triton.cdiv(n, POINTWISE_BLOCK),)](target, n, seed, offset, float(a), float(b), NORMAL=normal,
                                                    BLOCK=POINTWISE_BLOCK, num_warps=warps(POINTWISE_BLOCK))
    return self if target is self else self.copy_(target)


def _uniform(like: torch.Tensor, generator) -> torch.Tensor:
    """fp32 numbers in [0, 1) of `like`'s shape."""
    return random_(torch.empty(like.shape, dtype=torch.float32, device=like.device), 0.0, 1.0, False, generator)


def _check_multinomial(probs: torch.Tensor, num_samples: int, replacement: bool) -> None:
    """PyTorch's refusals of a multinomial call, with its messages."""
    if probs.dim() not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not probs.is_floating_point():
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: {probs.dtype}")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > probs.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    rows = probs.reshape(-1, probs.shape[-1]).float()
    bad = OPS["logical_or"](OPS["logical_or"](OPS["lt"](rows, 0), OPS["isnan"](rows)), OPS["isinf"](rows))
    if probs.numel() and bool(reductions.all_any(bad, None, False, True)):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    positive = reductions.reduce(OPS["gt"](rows, 0).to(torch.int64), 1, False, "sum")
    if rows.shape[0] and int(reductions.reduce(positive, None, False, "min").item()) == 0:
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")


def _gumbel_argmax(logp: torch.Tensor, generator) -> torch.Tensor:
    """argmax(log p - log(-log u)) along the last dimension, keeping it: a draw from softmax(log p)."""
    noise = OPS["neg"](OPS["log"](OPS["neg"](OPS["log"](OPS["clamp_min"](_uniform(logp, generator), 1e-20)))))
    return reductions.arg_reduce(pointwise_ops.add(logp, noise), -1, True, True)[1]


def multinomial(self: torch.Tensor, num_samples: int, replacement: bool = False, *, generator=None):
    """Samples by the Gumbel-max trick: with replacement every draw at once, without one draw at a time, each
    pick's probability set to zero after it."""
    _check_multinomial(self, num_samples, replacement)
    probs = self if self.dim() == 2 else self[None]
    logp = OPS["log"](probs.float())
    if replacement:
        out = _gumbel_argmax(logp[:, None, :].expand(-1, num_samples, -1), generator)[..., 0]
    else:  # past the positive categories, the zero ones in order (as PyTorch's CPU kernel draws them too)
        logp = OPS["clamp_min"](logp, -1e30)
        picks = []
        for _ in range(num_samples):
            pick = _gumbel_argmax(logp, generator)
            picks.append(pick)
            logp = put(logp, 1, pick, torch.full_like(pick, -math.inf, dtype=logp.dtype), True, False)
        out = cat(picks, -1)
    return out if self.dim() == 2 else out[0]


def exponential_(self, lambd=1.0, *, generator=None):
    """-log(1 - u) / lambd, u uniform in [0, 1)."""
    u = _uniform(self, generator)
    return OPS["div"](OPS["neg"](OPS["log1p"](OPS["neg"](u))), lambd, out=self)


def native_dropout(input, p, train):
    if not train or p == 0:
        return OPS["copy"](input), torch.ones_like(input, dtype=torch.bool)
    mask = OPS["ge"](_uniform(input, None), p)
    return OPS["dropout_backward"](input, mask, 1.0 / (1.0 - p)) if p < 1 else pointwise_ops.mul(input, 0), mask


ATEN = {
    "uniform_": lambda self, from_=0.0, to=1.0, *, generator=None: random_(self, from_, to, False, generator),
    "normal_": lambda self, mean=0.0, std=1.0, *, generator=None: random_(self, mean, std, True, generator),
    "multinomial": multinomial,
    "exponential_": exponential_,
    "bernoulli_.float": lambda self, p=0.5, *, generator=None: OPS["lt"](_uniform(self, generator), p, out=self),
    "native_dropout": native_dropout,
    "native_dropout_backward": lambda grad_output, mask, scale: OPS["dropout_backward"](
        grad_output, mask, scale).to(grad_output.dtype),
}
