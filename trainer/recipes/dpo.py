"""`recipe=dpo`: Direct Preference Optimization (Rafailov et al., 2023) against a frozen reference model, with the
loss types of TRL 1.16's DPOTrainer (`recipe.loss_type`, `recipe.label_smoothing`; TRL's names and defaults).

For a prompt x with a chosen answer y_w and a rejected one y_l, with log-probabilities of the answers' tokens
summed per sequence under the policy (pi) and the reference (ref), and d = (log pi(y_w|x) - log ref(y_w|x)) -
(log pi(y_l|x) - log ref(y_l|x)):

    sigmoid  -log sigmoid(beta * d)                                               (the paper's; the default)
    hinge    relu(1 - beta * d)                                                   (SLiC)
    ipo      (d' - 1 / (2 beta))^2, d' as d with each answer's log-ratio over its token count   (IPO)
    robust   (-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2e), e = label_smoothing  (rDPO)

averaged over pairs. The rewards are beta * (log pi - log ref) of each answer; the margin is chosen minus
rejected; the accuracy is the share of pairs whose chosen reward is the higher. A `data=preference` row holds the
chosen conversation's tokens, then the rejected one's, each with its loss mask and real length; the answers reach
the model as `data.packing` says (`trainer.data.packing`: padding_free, each answer a document of one packed row).
The log-probabilities come from the model's forward a chunk of tokens at a time (`trainer.models.chunked`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.config import recipe as config_recipe
from trainer.data import packing
from trainer.models import chunked, lora
from trainer.parallel.assembly import assemble
from trainer.recipes.base import Recipe, local
from trainer.recipes.sft import IGNORE, targets

LOSS_TYPES = config_recipe.LOSS_TYPES["dpo"]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean DPO loss over pairs of `loss_type`, and the batch's mean rewards, margin, accuracy and
    log-probabilities. ipo: `chosen_tokens`, `rejected_tokens` are each answer's counted tokens."""
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        per_pair = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        per_pair = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type='ipo' divides each answer's log-ratio by its token count: give them")
        mean_delta = chosen_ratio / chosen_tokens.clamp(min=1.0) - rejected_ratio / rejected_tokens.clamp(min=1.0)
        per_pair = (mean_delta - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        per_pair = (clean - flipped) / (1 - 2 * label_smoothing)
    else:
        raise ValueError(f"loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
    chosen, rejected = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
        "logps/chosen": policy_chosen.detach().mean(),
        "logps/rejected": policy_rejected.detach().mean(),
    }
    return per_pair.mean(), stats


def pair_rows(batch_tokens: torch.Tensor, batch_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of a batch of preference rows (chosen tokens, then rejected tokens): the chosen
    sequences, then the rejected ones."""
    half = batch_tokens.shape[1] // 2
    tokens = torch.cat([batch_tokens[:, :half], batch_tokens[:, half:]])
    mask = torch.cat([batch_mask[:, :half], batch_mask[:, half:]])
    return tokens, targets({"loss_mask": mask}, tokens)


def pair_loss(model, reference, micro: packing.Packed, settings: dict, loss_fn=chunked.token_logps):
    """The DPO loss of a micro-batch of pairs, its rows the chosen sequences then the rejected ones (`pair_rows`)
    as `data.packing` gives them to the model; `settings` holds dpo_loss's beta, loss_type and label_smoothing."""
    inputs, documents, target = micro.tokens[:, :-1], micro.inputs_documents, micro.target
    with torch.no_grad():  # first: the policy's forward is then the last before its backward
        ref = packing.unpack(reference(inputs, target, documents, loss_fn=loss_fn), micro).sum(-1)
    policy = packing.unpack(model(inputs, target, documents, loss_fn=loss_fn), micro).sum(-1)
    counts = packing.unpack((target != IGNORE).to(policy.dtype), micro).sum(-1)
    return dpo_loss(*policy.chunk(2), *ref.chunk(2), **settings, chosen_tokens=counts.chunk(2)[0],
                    rejected_tokens=counts.chunk(2)[1])


def frozen_reference(cfg, model, ctx):
    """The frozen starting model that dpo and kto compare the policy `model` with: under peft=lora the policy with
    its adapters off (no second copy), else a frozen copy assembled as the policy is."""
    if cfg.peft.name == "lora":
        return lora.without_adapters(model)
    return assemble(cfg.model, cfg, ctx.dims, ctx.kernels, peft=False, qat=False, frozen=True)


class DPO(Recipe):
    """`recipe=dpo` on data=preference: `pair_loss` against the frozen starting model (with peft=lora the
    policy with its adapters off, so the reference costs no second copy); its rewards go on metrics lines."""

    def __init__(self, cfg, model, ctx):
        super().__init__(cfg, model, ctx)
        self.reference = frozen_reference(cfg, model, ctx)
        r = cfg.recipe
        self.settings = {"beta": r.beta, "loss_type": r.loss_type, "label_smoothing": r.label_smoothing}
        self.logps_fn = ctx.kernels.token_logps
        self.packing = packing.choose(cfg.data.packing, ctx.pipeline is not None)

    def _micro(self, tokens: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor | None) -> packing.Packed:
        """A micro-batch of preference rows (with their two lengths each), collated as `data.packing` says."""
        tokens, target = pair_rows(tokens, mask.to(tokens.device))
        lengths = None if lengths is None else torch.cat([lengths[:, 0], lengths[:, 1]])
        real = packing.input_lengths(lengths, *target.shape)
        return packing.collate(tokens, target, real, self.packing, self.ctx.dims.sequence_multiple)

    def _loss(self, micro: packing.Packed) -> torch.Tensor:
        with self.ctx.autocast:
            loss, stats = pair_loss(self.model, self.reference, micro, self.settings, self.logps_fn)
        self.add_stats(stats, 1 / self.cfg.train.grad_accum_steps)
        return loss

    def micro_batches(self, batch: dict, accum: int) -> list:
        lengths = batch.get("lengths")
        parts = zip(self.tokens(batch).chunk(accum), batch["loss_mask"].chunk(accum),
                    lengths.chunk(accum) if lengths is not None else [None] * accum, strict=True)
        micros = [self._micro(*part) for part in parts]
        real = packing.input_lengths(None if lengths is None else lengths.flatten(), 2 * len(batch["tokens"]),
                                     batch["tokens"].shape[1] // 2 - 1)
        self.count(int(real.sum()), sum((m.target != IGNORE).sum() for m in micros))
        return micros

    def loss(self, micro) -> torch.Tensor:
        return self._loss(micro) / self.cfg.train.grad_accum_steps

    def eval_loss(self, batch: dict) -> torch.Tensor:
        micro = self._micro(self.tokens(batch), batch["loss_mask"], batch.get("lengths"))
        with self.kept_stats(), self.ctx.loss_context():
            return local(self._loss(micro))
