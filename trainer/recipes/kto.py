"""`recipe=kto`: Kahneman-Tversky Optimization (Ethayarajh et al., 2024) on unpaired desirable and undesirable
completions against a frozen reference model, as TRL 1.16's KTOTrainer computes it (`recipe.loss_type`, `beta`,
`desirable_weight`, `undesirable_weight`; TRL's names and defaults).

For a completion y of prompt x with r = log pi(y|x) - log ref(y|x) (its tokens' log-probabilities summed):

    kto                desirable: 1 - sigmoid(beta (r - z)), undesirable: 1 - sigmoid(beta (z - r))   (the default)
    apo_zero_unpaired  desirable: 1 - sigmoid(beta r),       undesirable: sigmoid(beta r)             (APO-zero)

each weighted by `desirable_weight` or `undesirable_weight`, averaged over the micro-batch's completions. z is the
batch's KL estimate (kto only): each prompt of a micro-batch with the completion of the row before it (the first
with the last's: TRL's rotation by one, its mismatched pairs), z = the mean over them of log pi - log ref, averaged
over the ranks, at least 0, a constant. Its sequences run under no_grad, the policy's too, as TRL runs them.

Rows are `trainer.data.unpaired`'s (each prompt and completion apart); a micro-batch makes each sequence, prompt
then completion, cut to data.seq_len + 1 tokens (TRL's max_length), and collates them as `data.packing` says
(`trainer.recipes.grpo.micro_rows`: the prompt and completion rows GRPO's loss takes). The log-probabilities come a
chunk of tokens at a time (`trainer.models.chunked` through the kernel switch), never from the whole logits. The
metrics are TRL's: `rewards/chosen`, `rewards/rejected` (beta r), `rewards/margins`, `logps/chosen`,
`logps/rejected` (the sums over every rank's completions of a kind over their number, per micro-batch, averaged
over the micro-batches that hold one), and `kl` (z).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.config import recipe as config_recipe
from trainer.data import packing
from trainer.recipes import dpo, grpo
from trainer.recipes.base import Recipe, local

LOSS_TYPES = config_recipe.LOSS_TYPES["kto"]
# The metrics TRL logs as sums over completions of a kind (chosen: desirable) over their number.
KINDS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
METRICS = (*KINDS, "rewards/margins", "kl")


def kto_loss(policy: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor, beta: float,
             loss_type: str = "kto", desirable_weight: float = 1.0, undesirable_weight: float = 1.0
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean KTO loss of `loss_type` over completions whose summed log-probabilities are `policy` and `ref`,
    desirable where `labels`, against the KL estimate `kl` (a constant); and this batch's sums of TRL's metrics
    (`KINDS`) with the counts of each kind (`n/chosen`, `n/rejected`)."""
    chosen = labels.bool()
    ratio = policy - ref
    if loss_type == "kto":
        losses = torch.where(chosen, 1 - F.sigmoid(beta * (ratio - kl)), 1 - F.sigmoid(beta * (kl - ratio)))
    elif loss_type == "apo_zero_unpaired":
        losses = torch.where(chosen, 1 - F.sigmoid(beta * ratio), F.sigmoid(beta * ratio))
    else:
        raise ValueError(f"loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
    weights = torch.where(chosen, losses.new_tensor(desirable_weight), losses.new_tensor(undesirable_weight))
    rewards, logps = beta * ratio.detach(), policy.detach()
    sums = {"rewards/chosen": rewards[chosen].sum(), "rewards/rejected": rewards[~chosen].sum(),
            "logps/chosen": logps[chosen].sum(), "logps/rejected": logps[~chosen].sum(),
            "n/chosen": chosen.sum().to(logps.dtype), "n/rejected": (~chosen).sum().to(logps.dtype)}
    return (weights * losses).mean(), sums


def kl_estimate(policy_kl: torch.Tensor, ref_kl: torch.Tensor) -> torch.Tensor:
    """TRL's KL estimate from the mismatched pairs' summed log-probabilities: their mean difference on this rank,
    averaged over the ranks (tensor-parallel peers hold the same rows, and count alike), at least 0."""
    kl = (policy_kl - ref_kl).mean().detach()
    if dist.is_initialized():
        dist.all_reduce(kl)
        kl = kl / dist.get_world_size()
    return kl.clamp(min=0)


def across_ranks(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`kto_loss`'s sums over every rank (TRL's gather_for_metrics), each kind's metric over its count; a kind no
    rank holds is left out (TRL appends none), and the margin only where both are there. Tensor-parallel peers add
    the same rows, to the sums and the counts alike."""
    names = list(sums)
    total = torch.stack([sums[k].float() for k in names])
    if dist.is_initialized():
        dist.all_reduce(total)
    got = dict(zip(names, total, strict=True))
    out = {k: got[k] / got[f"n/{k.split('/')[1]}"] for k in KINDS if got[f"n/{k.split('/')[1]}"] > 0}
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def sequences(tokens: torch.Tensor, lengths: torch.Tensor, rotate: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, completions) of a micro-batch of `trainer.data.unpaired` rows: each prompt and its completion cut
    to the row's width (data.seq_len + 1); `rotate`: each prompt with the completion of the row before it (the
    first with the last's), TRL's mismatched KL pairs."""
    width = tokens.shape[1] // 2
    rows, lengths = tokens.tolist(), lengths.tolist()
    prompts = [row[:p] for row, (p, _) in zip(rows, lengths, strict=True)]
    completions = [row[width : width + c] for row, (_, c) in zip(rows, lengths, strict=True)]
    if rotate:
        completions = completions[-1:] + completions[:-1]
    return prompts, [c[: width - len(p)] for p, c in zip(prompts, completions, strict=True)]


@dataclass
class Micro:
    """A micro-batch: its sequences as the model takes them, the mismatched KL ones (None for apo_zero_unpaired),
    and each completion's label (1: desirable)."""

    matched: packing.Packed
    kl: packing.Packed | None
    labels: torch.Tensor


def micro_batch(tokens: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor, way: str, kl: bool,
                multiple: int = 1, device: torch.device | None = None) -> tuple[Micro, int, int]:
    """The micro-batch of `trainer.data.unpaired` rows collated as `way` (a `data.packing`) says, with its KL
    sequences where `kl`; and its sequences' real input tokens and completion tokens."""

    def collate(prompts, completions):
        (micro,), mask, real = grpo.micro_rows(prompts, completions, 0, way, 1, multiple, device)
        return micro, real, int(mask.sum())

    matched, real, trained = collate(*sequences(tokens, lengths, rotate=False))
    mismatched = collate(*sequences(tokens, lengths, rotate=True))[0] if kl else None
    return Micro(matched, mismatched, labels.to(device).bool()), real, trained


def unpaired_loss(model, reference, micro: Micro, settings: dict, loss_fn
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """`kto_loss` of a micro-batch (its sums, and the KL estimate): the reference's and the KL pairs' forwards
    under no_grad, then the policy's; `settings` holds kto_loss's beta, loss_type and weights."""

    def logps(m, packed: packing.Packed) -> torch.Tensor:
        return grpo.token_logps(m, packed, loss_fn).sum(-1)

    with torch.no_grad():  # first: the policy's forward is then the last before its backward
        ref = logps(reference, micro.matched)
        kl = torch.zeros((), device=ref.device, dtype=ref.dtype)
        if micro.kl is not None:
            kl = kl_estimate(logps(model, micro.kl), logps(reference, micro.kl))
    loss, sums = kto_loss(logps(model, micro.matched), ref, micro.labels, kl, **settings)
    return loss, sums, kl


class KTO(Recipe):
    """`recipe=kto` on data=preference's unpaired rows: `unpaired_loss` against the frozen starting model (with
    peft=lora the policy with its adapters off, so the reference costs no second copy)."""

    def __init__(self, cfg, model, ctx):
        super().__init__(cfg, model, ctx)
        self.reference = dpo.frozen_reference(cfg, model, ctx)
        r = cfg.recipe
        self.settings = {"beta": r.beta, "loss_type": r.loss_type, "desirable_weight": r.desirable_weight,
                         "undesirable_weight": r.undesirable_weight}
        self.logps_fn = ctx.kernels.token_logps
        self.packing = packing.choose(cfg.data.packing, ctx.pipeline is not None)

    def _micro(self, tokens: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor) -> tuple[Micro, int, int]:
        return micro_batch(tokens, lengths, labels, self.packing, self.settings["loss_type"] == "kto",
                           self.ctx.dims.tp, self.ctx.device)

    def _loss(self, micro: Micro) -> torch.Tensor:
        with self.ctx.autocast:
            loss, sums, kl = unpaired_loss(self.model, self.reference, micro, self.settings, self.logps_fn)
        stats = across_ranks(sums)
        stats["kl"] = kl
        for key, value in stats.items():  # TRL's: each metric averaged over the micro-batches that log it
            self.stats[f"sum:{key}"] = self.stats.get(f"sum:{key}", 0) + value.detach()
            self.stats[f"n:{key}"] = self.stats.get(f"n:{key}", 0) + 1
        return loss

    def micro_batches(self, batch: dict, accum: int) -> list:
        parts = zip(batch["tokens"].chunk(accum), batch["lengths"].chunk(accum), batch["label"].chunk(accum),
                    strict=True)
        micros, real, trained = [], 0, 0
        for part in parts:
            micro, r, t = self._micro(*part)
            micros.append(micro)
            real, trained = real + r, trained + t
        self.count(real, trained)
        return micros

    def loss(self, micro) -> torch.Tensor:
        return self._loss(micro) / self.cfg.train.grad_accum_steps

    def eval_loss(self, batch: dict) -> torch.Tensor:
        micro, _, _ = self._micro(batch["tokens"], batch["lengths"], batch["label"])
        with self.kept_stats(), self.ctx.loss_context():
            return local(self._loss(micro))

    def record(self, steps: int) -> dict[str, float]:
        """TRL's metrics: every rank holds the same (summed over the ranks already), each the mean over the
        micro-batches that logged it."""
        sums = {k.removeprefix("sum:"): self.stats.pop(k) for k in [k for k in self.stats if k.startswith("sum:")]}
        counts = {k.removeprefix("n:"): self.stats.pop(k) for k in [k for k in self.stats if k.startswith("n:")]}
        line = super().record(steps)
        return {**line, **{k: float(sums[k]) / counts[k] for k in sorted(sums)}}
