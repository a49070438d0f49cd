"""TRL 1.16's own loss code, called on given log-probabilities: `GRPOTrainer._compute_loss` and
`DPOTrainer._compute_loss`, each run as the unbound method on a stand-in for the trainer that holds the settings
the method reads and a model whose forward returns the given per-token log-probabilities. Nothing of the loss is
re-typed here: what differs between loss types is TRL's code."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl import GRPOConfig
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.grpo_trainer import GRPOTrainer


class _Accelerator:
    """One process of `num_processes`: its gathers and reductions see only its own values (they feed TRL's
    metrics, not its loss)."""

    def __init__(self, num_processes: int = 1):
        self.num_processes, self.device = num_processes, torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


# GRPOConfig's settings that `_compute_loss` reads from `self.args` for its loss types, at TRL's defaults.
GRPO_ARGS = ("delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
             "vespo_k_neg", "vespo_lambda_neg", "use_bias_correction_kl")


def grpo(logps, old, ref, advantages, mask, *, loss_type, importance_sampling_level="token", epsilon=0.2,
         epsilon_high=None, beta=0.0, accum=1, num_processes=1, num_items_in_batch=None, max_completion_length=None,
         **settings):
    """TRL's GRPO loss of one micro-batch (one of `accum` of a generation batch that spans `accum` micro-batches on
    each of `num_processes` ranks, `num_items_in_batch` completion tokens in all); `settings`: those of
    `GRPO_ARGS` that differ from GRPOConfig's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name in GRPO_ARGS}
    args = {**defaults, **settings, "steps_per_generation": accum}
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=importance_sampling_level,
        beta=beta, loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else
        epsilon_high, use_vllm=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=accum,
        accelerator=_Accelerator(num_processes), max_completion_length=max_completion_length,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(**args), get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )
    n, length = mask.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, length, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": torch.as_tensor(mask.sum() if num_items_in_batch is None else num_items_in_batch,
                                              dtype=logps.dtype),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, dict(trainer._metrics["train"])


def dpo(policy_token_logps, ref_chosen, ref_rejected, completion_mask, *, loss_type, beta, label_smoothing=0.0):
    """TRL's DPO loss of a batch whose policy per-token log-probabilities are `policy_token_logps` (2 x pairs,
    tokens - 1: the chosen sequences, then the rejected ones) over `completion_mask` (2 x pairs, tokens), with the
    reference's sequence log-probabilities given (TRL's precompute_ref_logps)."""
    shape = policy_token_logps.shape

    def model(**kwargs):
        return SimpleNamespace(log_probs=policy_token_logps, entropy=torch.zeros(shape),
                               mean_logits=torch.zeros(shape), is_top1=torch.zeros(shape, dtype=torch.bool))

    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1,
    )
    inputs = {"input_ids": torch.zeros(completion_mask.shape, dtype=torch.long),
              "attention_mask": torch.ones_like(completion_mask), "completion_mask": completion_mask,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, False)
    return loss, dict(trainer._metrics["train"])
