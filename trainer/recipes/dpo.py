"""`recipe=dpo`: Direct Preference Optimization (Rafailov et al., 2023) against a frozen reference model.

For a prompt x with a chosen answer y_w and a rejected one y_l, with log-probabilities of the answers'
tokens summed per sequence under the policy (pi) and the reference (ref):

    loss = -log sigmoid(beta * ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))))

averaged over pairs. The rewards are beta * (log pi - log ref) of each answer; the margin is chosen minus
rejected; the accuracy is the share of pairs whose chosen reward is the higher. A `data=preference` row
holds the chosen conversation's tokens, then the rejected one's, each with its loss mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from trainer.models import lora
from trainer.models.assembly import assemble
from trainer.recipes.base import Recipe, local
from trainer.recipes.sft import IGNORE, targets

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def token_logps(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(batch, seq) log p(target) at each position, 0 where the target is IGNORE; logits (batch, seq, vocab).
    Taken as a cross-entropy, so that under loss parallelism (inside `loss_parallel()`) logits split over the
    vocabulary give them without being gathered."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="none")
    if isinstance(nll, DTensor):  # the same on every tensor-parallel rank
        nll = nll.to_local()
    return -nll.view(target.shape)


def sequence_logps(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(batch,) sums of log p(target) over the counted (not IGNORE) positions (`token_logps`)."""
    return token_logps(logits, target).sum(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean DPO loss over pairs, and the batch's mean rewards, margin and accuracy."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    loss = -F.logsigmoid(chosen - rejected).mean()
    stats = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
    }
    return loss, {k: v.detach() for k, v in stats.items()}


def pair_loss(model, reference, batch_tokens: torch.Tensor, batch_mask: torch.Tensor, beta: float):
    """The DPO loss of a batch of preference rows (chosen tokens, then rejected tokens)."""
    half = batch_tokens.shape[1] // 2
    tokens = torch.cat([batch_tokens[:, :half], batch_tokens[:, half:]])
    mask = torch.cat([batch_mask[:, :half], batch_mask[:, half:]])
    target = targets({"loss_mask": mask}, tokens)
    with torch.no_grad():  # first: the policy's forward is then the last before its backward
        ref = sequence_logps(reference(tokens[:, :-1]), target)
    policy = sequence_logps(model(tokens[:, :-1]), target)
    policy_chosen, policy_rejected = policy.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    return dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)


class DPO(Recipe):
    """`recipe=dpo` on data=preference: `pair_loss` against the frozen starting model (with peft=lora the
    policy with its adapters off, so the reference costs no second copy); its rewards go on metrics lines."""

    def __init__(self, cfg, model, ctx):
        super().__init__(cfg, model, ctx)
        if cfg.peft.name == "lora":
            self.reference = lora.without_adapters(model)
        else:
            self.reference = assemble(cfg.model, cfg, ctx.dims, peft=False, qat=False, frozen=True)

    def _loss(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with self.ctx.autocast:
            loss, stats = pair_loss(self.model, self.reference, tokens, mask.to(self.ctx.device), self.cfg.recipe.beta)
        self.add_stats(stats, 1 / self.cfg.train.grad_accum_steps)
        return loss

    def micro_batches(self, batch: dict, accum: int) -> list:
        return list(zip(self.tokens(batch).chunk(accum), batch["loss_mask"].chunk(accum), strict=True))

    def loss(self, micro) -> torch.Tensor:
        tokens, mask = micro
        return self._loss(tokens, mask) / self.cfg.train.grad_accum_steps

    def eval_loss(self, batch: dict) -> torch.Tensor:
        with self.kept_stats(), self.ctx.loss_context():
            return local(self._loss(self.tokens(batch), batch["loss_mask"]))
