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
chosen conversation's tokens, then the rejected one's, each with its loss mask; with data.packing the rows hold
whole pairs one after another, numbered as documents (`trainer.data.chat`), and each answer is one document. The
log-probabilities come from the model's forward a chunk of tokens at a time (`trainer.models.chunked`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from trainer.assembly import assemble
from trainer.config import recipe as config_recipe
from trainer.models import chunked, lora
from trainer.models.kernels import model_ops
from trainer.recipes.base import Recipe, local
from trainer.recipes.sft import IGNORE, shares, targets

LOSS_TYPES = config_recipe.LOSS_TYPES["dpo"]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def logps_fn(kernels_cfg):
    """The model's `loss_fn` that gives (batch, seq) log p(target) (`chunked.token_logps`), its chunks' log-softmax
    the Triton cross-entropy where kernels=triton routes the loss."""
    if "fused_linear_cross_entropy" in model_ops(kernels_cfg):
        import ops

        return functools.partial(chunked.token_logps, ce=ops.cross_entropy)
    return chunked.token_logps


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


def pair_loss(model, reference, batch_tokens: torch.Tensor, batch_mask: torch.Tensor, settings: dict,
              loss_fn=chunked.token_logps):
    """The DPO loss of a batch of preference rows (chosen tokens, then rejected tokens); `settings` holds
    dpo_loss's beta, loss_type and label_smoothing."""
    tokens, target = pair_rows(batch_tokens, batch_mask)
    with torch.no_grad():  # first: the policy's forward is then the last before its backward
        ref = reference(tokens[:, :-1], target, loss_fn=loss_fn).sum(-1)
    policy = model(tokens[:, :-1], target, loss_fn=loss_fn).sum(-1)
    counts = (target != IGNORE).sum(-1).to(policy.dtype)
    return dpo_loss(*policy.chunk(2), *ref.chunk(2), **settings, chosen_tokens=counts.chunk(2)[0],
                    rejected_tokens=counts.chunk(2)[1])


def _per_document(values: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """(rows, positions) sums of `values` (rows, positions) over each row's documents (numbered below positions)."""
    rows, width = values.shape
    index = (torch.arange(rows, device=values.device)[:, None] * width + documents).flatten()
    return values.new_zeros(rows * width).index_add(0, index, values.flatten()).view(rows, width)


def packed_pairs(target: torch.Tensor, documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pairs a packed batch holds: (rows, pairs) booleans, each answer's counted targets: (rows, 2 x pairs))
    for targets and the inputs' document numbers (rows, positions): documents 2k and 2k + 1 of a row are pair k's
    chosen and rejected answers; padding and an unfinished pair count none."""
    counted = _per_document((target != IGNORE).to(torch.float32), documents)
    pairs = counted.shape[1] // 2
    return (counted[:, 0 : 2 * pairs : 2] > 0) & (counted[:, 1 : 2 * pairs : 2] > 0), counted


def packed_pair_loss(model, reference, tokens: torch.Tensor, mask: torch.Tensor, documents: torch.Tensor,
                     settings: dict, loss_fn=chunked.token_logps):
    """The mean DPO loss over the pairs of packed rows (`data.packing`: whole pairs one after another, each answer
    a document that attends within itself), as `pair_loss` takes it of the same pairs unpacked; 0 with none."""
    target = targets({"loss_mask": mask}, tokens)
    inputs, docs = tokens[:, :-1], documents[:, :-1]
    with torch.no_grad():
        ref = _per_document(reference(inputs, target, docs, loss_fn=loss_fn), docs)
    policy = model(inputs, target, docs, loss_fn=loss_fn)
    present, counted = packed_pairs(target, docs)
    if not present.any():  # still through the model, so that every parameter's gradient hook runs
        return policy.sum() * 0, {}
    policy = _per_document(policy, docs)
    n = present.shape[1]

    def chosen(x):
        return x[:, 0 : 2 * n : 2][present]

    def rejected(x):
        return x[:, 1 : 2 * n : 2][present]

    return dpo_loss(chosen(policy), rejected(policy), chosen(ref), rejected(ref), **settings,
                    chosen_tokens=chosen(counted).to(policy.dtype), rejected_tokens=rejected(counted).to(policy.dtype))


class DPO(Recipe):
    """`recipe=dpo` on data=preference: `pair_loss` against the frozen starting model (with peft=lora the
    policy with its adapters off, so the reference costs no second copy); its rewards go on metrics lines."""

    def __init__(self, cfg, model, ctx):
        super().__init__(cfg, model, ctx)
        if cfg.peft.name == "lora":
            self.reference = lora.without_adapters(model)
        else:
            self.reference = assemble(cfg.model, cfg, ctx.dims, peft=False, qat=False, frozen=True)
        r = cfg.recipe
        self.settings = {"beta": r.beta, "loss_type": r.loss_type, "label_smoothing": r.label_smoothing}
        self.logps_fn = logps_fn(cfg.kernels)

    def _loss(self, tokens: torch.Tensor, mask: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        mask = mask.to(self.ctx.device)
        with self.ctx.autocast:
            if documents is None:
                loss, stats = pair_loss(self.model, self.reference, tokens, mask, self.settings, self.logps_fn)
            else:
                loss, stats = packed_pair_loss(self.model, self.reference, tokens, mask,
                                               documents.to(self.ctx.device), self.settings, self.logps_fn)
        self.add_stats(stats, 1 / self.cfg.train.grad_accum_steps)
        return loss

    def _pairs(self, tokens: torch.Tensor, mask: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        """How many pairs packed rows hold."""
        target = targets({"loss_mask": mask}, tokens)
        return packed_pairs(target, documents[:, :-1].to(tokens.device))[0].sum().float()

    def micro_batches(self, batch: dict, accum: int) -> list:
        tokens, masks = self.tokens(batch).chunk(accum), batch["loss_mask"].chunk(accum)
        if "documents" not in batch:
            return [(t, m, None, 1 / accum) for t, m in zip(tokens, masks, strict=True)]
        # Packed rows hold different numbers of pairs: each micro-batch's mean weighs by its share of the step's.
        documents = batch["documents"].chunk(accum)
        scales = shares(torch.stack([self._pairs(*micro) for micro in zip(tokens, masks, documents, strict=True)]))
        return list(zip(tokens, masks, documents, scales, strict=True))

    def loss(self, micro) -> torch.Tensor:
        tokens, mask, documents, scale = micro
        return self._loss(tokens, mask, documents) * scale

    def eval_loss(self, batch: dict) -> torch.Tensor:
        tokens, documents = self.tokens(batch), batch.get("documents")
        scale = 1.0 if documents is None else shares(self._pairs(tokens, batch["loss_mask"], documents)[None])[0]
        with self.kept_stats(), self.ctx.loss_context():
            return local(self._loss(tokens, batch["loss_mask"], documents)) * scale
