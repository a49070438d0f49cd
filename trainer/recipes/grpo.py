"""`recipe=grpo`: Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath) on data=prompts, its loss
as TRL 1.16's GRPOTrainer takes it (its eight `recipe.loss_type`s with their settings,
`recipe.importance_sampling_level`; TRL's names and defaults).

Each prompt gets G completions; each completion's reward (the weighted sum over the reward functions) becomes its
advantage within its group:

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)      (scale_rewards=group; batch: the batch's std;
                                                              none: not divided; std with Bessel's correction)

and with per-token log-probabilities under the policy (logp), the policy that generated (old) and the frozen
reference (ref), the ratio rho = exp(logp - old) per completion token (importance_sampling_level=token), or
exp(mean over the completion's tokens of logp - old) per completion (sequence: GSPO), each token's loss is a
policy term, by `loss_type`, plus the KL penalty:

    token loss = policy term + beta * k3 * rho,      k3 = exp(ref - logp) - (ref - logp) - 1

(use_bias_correction_kl=false: k3 alone. The factor rho, TRL's default, makes the KL term's gradient the unbiased
one off policy, and changes it even at rho = 1.)

    grpo, bnpo, dr_grpo, dapo, luspo   -min(min(rho, delta) * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A)
                                       (delta null: no cap)
    cispo                              -sg(min(rho, epsilon_high)) * A * logp         (MiniMax-M1; sg: no gradient)
    sapo                               -sigmoid(tau * (rho - 1)) * 4 / tau * A        (tau: sapo_temperature_pos
                                                                                       where A > 0, else _neg)
    vespo                              -sg(phi(w)) * A * logp,  phi(w) = e^lambda * w^k * e^(-lambda * w)
                                       w the product of the completion's token ratios, k and lambda vespo_k_pos
                                       and vespo_lambda_pos where A >= 0, else _neg

summed over a micro-batch's completion tokens and normalised as `loss_type` says:

    grpo, sapo      each completion's mean token loss, averaged over completions
    bnpo            the micro-batch's mean token loss
    luspo           each completion's summed token loss, averaged over completions
    dr_grpo         the sum over (completions x recipe.max_completion_length)
    dapo, cispo,    the sum over the generation batch's completion tokens on every rank, over the number of ranks
    vespo           (TRL's num_items_in_batch / num_processes), so the step's gradient is the mean over every token
                    of every rank and micro-batch (dapo: the default)

each but dapo, cispo and vespo divided by the micro-batches of a step, and averaged over the data-parallel ranks by
the gradient reduction, as TRL's accumulation and DDP take it.
The KL term is the k3 estimator of KL(policy || reference). A completion with no counted token adds 0. The
log-probabilities come from the model's forward a chunk of tokens at a time (`trainer.models.chunked`).

`GRPO`, the recipe object: every `recipe.num_iterations` steps it samples `recipe.num_generations` completions
of each of its rank's prompts from the policy (`trainer.generate`; each rank its own prompts, tensor-parallel
peers the same ones with the same seed), scores them with the reward functions (`trainer.rewards.functions`) and
the reward model of recipe.reward_model.path (`trainer.recipes.reward_scorer`; its weight last), and keeps them,
with their advantages, the policy's log-probabilities at sampling (old) and the reference's, for the updates that
follow. A training row is the prompt, then its completion, then padding, so that positions
and attention are those of generation; the loss counts the completion's tokens, its end token included. The rows
of a micro-batch reach the model as `data.packing` says (`trainer.data.packing`; padding_free: each prompt and
completion a document of one packed row), for the loss and for the old and reference log-probabilities alike. The
reference is the policy with its adapters off under peft=lora, else a frozen copy of the starting weights; none
with recipe.beta=0. A resumed run starts a new generation batch at its first step. The eval loss is minus the
mean weighted reward of completions sampled for the eval prompts (the same seed at every eval). Each metrics line
holds the seconds of its generation batch's sampling (perf/generate_s), scoring (perf/score_s) and old and reference
log-probabilities (perf/logps_s); the rest of the step is training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from trainer.config import recipe as config_recipe
from trainer.config.recipe import is_async
from trainer.data import packing
from trainer.data.prompts import prompt_text
from trainer.generate import generate
from trainer.models import lora
from trainer.parallel.assembly import assemble
from trainer.recipes.async_rollouts import AsyncRollouts
from trainer.recipes.base import Recipe
from trainer.recipes.reward_scorer import RewardModel
from trainer.recipes.sft import IGNORE
from trainer.rewards import functions as reward_funcs

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = config_recipe.LOSS_TYPES["grpo"]
IMPORTANCE_LEVELS = config_recipe.IMPORTANCE_LEVELS
# The loss types' own settings beside epsilon and epsilon_high (delta, sapo_temperature_pos, ...) and the KL term's,
# with the schema's defaults (TRL's).
_OWN = {k for keys in config_recipe.LOSS_PARAMS.values() for k in keys} - {"epsilon", "epsilon_high"}
LOSS_SETTINGS = {f.name: f.default for f in dataclasses.fields(config_recipe.RecipeConfig)
                 if f.name in _OWN | {"use_bias_correction_kl"}}
VESPO = ("k_pos", "lambda_pos", "k_neg", "lambda_neg")  # vespo_<these>, in gamma_weights' order
# A metrics line's statistics of the loss, by loss type (TRL's names).
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
METRICS = {**{t: ("kl", *CLIP_METRICS, "completions/mean_length") for t in config_recipe.CLIPPED},
           "cispo": ("kl", "cispo_clip_ratio", "completions/mean_length"), "sapo": ("kl", "completions/mean_length"),
           "vespo": ("kl", "vespo/phi_seq_mean", "completions/mean_length")}


def advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """(n,) advantages of `rewards` (n,), the completions of each prompt side by side in groups of
    `num_generations`."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: must be one of {', '.join(SCALE_REWARDS)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"num_generations={num_generations} does not divide the {rewards.numel()} completions")
    groups = rewards.view(-1, num_generations)
    centred = (groups - groups.mean(1, keepdim=True)).flatten()
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = groups.std(1, keepdim=True).expand_as(groups).flatten() if num_generations > 1 else 0.0
    else:
        std = rewards.std() if rewards.numel() > 1 else 0.0
    return centred / (std + 1e-4)


def _ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The importance weights: per token (completions, tokens), or per completion (completions, 1), the exp of
    its tokens' mean log-ratio (GSPO, `importance_sampling_level=sequence`)."""
    log_ratio = logps - old_logps
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    elif level != "token":
        raise ValueError(f"importance_sampling_level={level!r}: must be one of {', '.join(IMPORTANCE_LEVELS)}")
    return torch.exp(log_ratio)


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, epsilon: float, high: float, delta: float | None) -> tuple:
    """grpo, bnpo, dr_grpo, dapo, luspo: -min(rho A, clip(rho, 1 - epsilon, 1 + high) A), the unclipped rho capped
    at `delta` where given (INTELLECT-2's two-sided clipping); the shares clipped on each side, of the capped rho as
    TRL counts them."""
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    ratio = ratio if delta is None else torch.clamp(ratio, max=delta)
    token_loss = -torch.min(ratio * adv, clipped * adv)
    low, top = (ratio < 1 - epsilon) & (adv < 0), (ratio > 1 + high) & (adv > 0)
    return token_loss, {"clip_ratio/low_mean": low, "clip_ratio/high_mean": top, "clip_ratio/region_mean": low | top}


def _weighted(logps: torch.Tensor, weight: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """cispo, vespo: the policy gradient's loss -w A logp, its weight w a constant (no gradient through it)."""
    return -weight.detach() * adv * logps


def _sapo(ratio: torch.Tensor, adv: torch.Tensor, pos: float, neg: float) -> torch.Tensor:
    """SAPO's soft gate: -sigmoid(tau (rho - 1)) 4 / tau A, tau `pos` where the advantage is positive, else `neg`."""
    tau = torch.where(adv > 0, pos, neg)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


@torch.no_grad()
def gamma_weights(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, k_pos: float, lambda_pos: float,
                  k_neg: float, lambda_neg: float) -> torch.Tensor:
    """VESPO's (completions, 1) weights phi(w) = e^lambda w^k e^(-lambda w) of each completion's ratio w (the product
    of its tokens' ratios, its log clamped to [log 1e-8, 20] as TRL clamps it), k and lambda by the advantage's sign
    (>= 0: pos), computed in log space."""
    log_w = torch.clamp((torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True), math.log(1e-8), 20.0)
    nonneg = adv >= 0
    k, lam = torch.where(nonneg, k_pos, k_neg), torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _policy_term(loss_type: str, logps: torch.Tensor, old_logps: torch.Tensor, ratio: torch.Tensor,
                 adv: torch.Tensor, mask: torch.Tensor, p: dict) -> tuple[torch.Tensor, dict]:
    """(each token's policy loss as `loss_type` takes it from the settings `p`, its statistics by TRL's names);
    `ratio`: the importance weights (`_ratio`)."""
    high = p["epsilon"] if p["epsilon_high"] is None else p["epsilon_high"]
    if loss_type in config_recipe.CLIPPED:
        return _clipped(ratio, adv, p["epsilon"], high, p["delta"])
    if loss_type == "cispo":
        return _weighted(logps, torch.clamp(ratio, max=high), adv), {"cispo_clip_ratio": (ratio > high) & (adv > 0)}
    if loss_type == "sapo":
        return _sapo(ratio, adv, p["sapo_temperature_pos"], p["sapo_temperature_neg"]), {}
    if loss_type == "vespo":
        phi = gamma_weights(logps - old_logps, adv, mask, *(p[f"vespo_{k}"] for k in VESPO))
        return _weighted(logps, phi, adv), {"vespo/phi_seq_mean": phi}
    raise ValueError(f"loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")


def _reduce(token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, accum: int,
            tokens_per_rank: float | torch.Tensor | None, max_completion_length: int | None) -> torch.Tensor:
    """A micro-batch's part of the step's loss, as TRL's `_compute_loss` takes it for `loss_type`."""
    if loss_type in ("grpo", "sapo"):
        return ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accum
    if loss_type == "bnpo":
        return (token_loss * mask).sum() / mask.sum().clamp(min=1.0) / accum
    if loss_type == "luspo":  # each completion's sum: its (sequence-level) loss times its length
        return (token_loss * mask).sum(-1).mean() / accum
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length: give it")
        return (token_loss * mask).sum() / (token_loss.shape[0] * max_completion_length) / accum
    if tokens_per_rank is None:  # dapo, cispo, vespo
        raise ValueError(f"loss_type={loss_type!r} divides by the generation batch's tokens per rank: give them")
    return (token_loss * mask).sum() / torch.as_tensor(tokens_per_rank, dtype=token_loss.dtype,
                                                        device=token_loss.device)


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              epsilon: float, epsilon_high: float | None = None, beta: float = 0.0,
              ref_logps: torch.Tensor | None = None, loss_type: str = "dapo", importance_sampling_level: str = "token",
              accum: int = 1, tokens_per_rank: float | torch.Tensor | None = None,
              max_completion_length: int | None = None, **params: float | bool | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's part of the step's loss (one of `accum` micro-batches of a generation batch) and its
    statistics, named as TRL's metrics (masked means over completion tokens, or over completions with
    sequence-level weights). logps, old_logps, ref_logps, mask: (completions, tokens); advantages: (completions,).
    dapo, cispo, vespo: `tokens_per_rank` is the generation batch's counted tokens on every rank over the number of
    ranks (`dapo_tokens_per_rank`); dr_grpo: `max_completion_length` is the constant length it divides by.
    `params`: the loss types' own settings and the KL term's by TRL's names (`LOSS_SETTINGS`: delta,
    sapo_temperature_pos, ..., use_bias_correction_kl; TRL's defaults)."""
    unknown = sorted(set(params) - set(LOSS_SETTINGS))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a setting of a GRPO loss type (one of {', '.join(LOSS_SETTINGS)})")
    mask = mask.to(logps.dtype)
    p = {**LOSS_SETTINGS, **params, "epsilon": epsilon, "epsilon_high": epsilon_high}
    ratio = _ratio(logps, old_logps, mask, importance_sampling_level)
    token_loss, stats = _policy_term(loss_type, logps, old_logps, ratio, advantages[:, None], mask, p)
    kl = torch.zeros_like(logps)
    if beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if p["use_bias_correction_kl"]:  # the unbiased reverse-KL gradient off policy (DeepSeek-V3.2)
            kl = kl * ratio
        token_loss = token_loss + beta * kl
    loss = _reduce(token_loss, mask, loss_type, accum, tokens_per_rank, max_completion_length)
    counted = mask.sum().clamp(min=1)

    def masked_mean(x: torch.Tensor) -> torch.Tensor:
        x = x.to(mask.dtype)
        return x.mean() if x.shape[1] == 1 else (x * mask).sum() / counted

    stats = {"kl": masked_mean(kl), **{k: masked_mean(v) for k, v in stats.items()},
             "completions/mean_length": mask.sum(-1).mean()}
    return loss, {k: v.detach() for k, v in stats.items()}


def dapo_tokens_per_rank(masks: list[torch.Tensor]) -> torch.Tensor:
    """The counted tokens of a generation batch (its micro-batches' masks) on every rank, over the number of
    ranks: TRL's `num_items_in_batch / num_processes`. Tensor-parallel peers hold the same rows; they count in
    both the sum and the number of ranks, and cancel."""
    total = torch.stack([m.sum() for m in masks]).sum().float()
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.clamp(min=1.0) / (dist.get_world_size() if dist.is_initialized() else 1)


class GRPO(Recipe):
    def __init__(self, cfg, model, ctx):
        super().__init__(cfg, model, ctx)
        r = cfg.recipe
        self.r, self.G = r, r.num_generations
        self.sampling(cfg, model, ctx, r.beta)
        self.buffer: list | None = None  # the generation batch's micro-batches
        self.tokens_per_rank = None  # loss_type=dapo's normaliser of the generation batch
        self.logps_fn = ctx.kernels.token_logps
        self.packing = packing.choose(cfg.data.packing, False)
        self.rollouts = AsyncRollouts(self) if is_async(r) else None  # it reads the batches itself, one ahead
        self.reward_stats: dict[str, torch.Tensor] = {}

    def sampling(self, cfg, model, ctx, kl_weight: float) -> None:
        """What sampling and scoring take (shared with recipe=ppo): the reward functions, the reward model, their
        weights, the prompts' text, the frozen reference (none at `kl_weight` 0: the policy with its adapters off
        under peft=lora, else a frozen copy of the starting weights), the data-parallel rank and its generator."""
        r = cfg.recipe
        self.funcs = [(spec, reward_funcs.load(spec)) for spec in r.reward_funcs]
        self.reward_model = RewardModel(cfg, ctx) if r.reward_model.path else None
        count = len(self.funcs) + (self.reward_model is not None)
        self.weights = list(r.reward_weights) if r.reward_weights is not None else [1.0] * count
        self.text = prompt_text(cfg.model)
        self.reference = None
        if kl_weight > 0:
            self.reference = (lora.without_adapters(model) if cfg.peft.name == "lora"
                              else assemble(cfg.model, cfg, ctx.dims, ctx.kernels, peft=False, qat=False, frozen=True))
        self.dp_rank, self.dp_size = ctx.dims.data_parallel_rank()
        self.generator = torch.Generator(ctx.device).manual_seed(cfg.train.seed * 1_000_003 + self.dp_rank)

    @property
    def rows_per_step(self) -> int:
        return self.cfg.train.global_batch_size // self.G

    def data_steps(self, step: int) -> int:
        return math.ceil(step / self.r.num_iterations)

    def wants_batch(self, step: int) -> bool:
        return self.rollouts is None and (self.buffer is None or step % self.r.num_iterations == 0)

    def micro_batches(self, batch: dict | None, accum: int) -> list:
        if batch is not None or self.rollouts is not None:
            self.buffer = self._generation_batch(batch, accum)
            self.tokens_per_rank = dapo_tokens_per_rank([micro[1] for micro in self.buffer])
        self.add_stats(self.reward_stats)
        self.count(self.real_tokens, sum(micro[1].sum() for micro in self.buffer))  # each iteration trains again
        return self.buffer

    def loss(self, micro) -> torch.Tensor:
        rows, mask, adv, old, ref = micro
        with self.ctx.autocast:
            logps = self.token_logps(self.model, rows)
        accum = self.cfg.train.grad_accum_steps
        loss, stats = grpo_loss(logps, logps.detach() if old is None else old, adv, mask, self.r.epsilon,
                                self.r.epsilon_high, self.r.beta, ref, self.r.loss_type,
                                self.r.importance_sampling_level, accum, self.tokens_per_rank,
                                self.r.max_completion_length, **{k: getattr(self.r, k) for k in LOSS_SETTINGS})
        self.add_stats(stats, 1 / accum)
        return loss

    def eval_loss(self, batch: dict) -> torch.Tensor:
        generator = torch.Generator(self.ctx.device).manual_seed(self.cfg.train.seed + 7919 * (self.dp_rank + 1))
        prompts, rows = self._prompts(batch)
        completions = self._sample(prompts, generator)
        scores, _ = self._rewards(rows, prompts, completions)
        return -scores.mean()

    def _prompts(self, batch: dict) -> tuple[list[list[int]], list[dict]]:
        lengths = batch["length"].tolist()
        prompts = [row[:n] for row, n in zip(batch["tokens"].tolist(), lengths, strict=True)]
        return prompts, [json.loads(r) for r in batch["rows"]]

    def _sample(self, prompts: list[list[int]], generator: torch.Generator, model=None, autocast=None
                ) -> list[list[int]]:
        repeated = [p for p in prompts for _ in range(self.G)]
        model = self.model if model is None else model
        with self.ctx.autocast if autocast is None else autocast:
            return generate(model, repeated, self.r.max_completion_length, eos=self.text.eos,
                            pad=self.text.pad, temperature=self.r.temperature, top_k=self.r.top_k, top_p=self.r.top_p,
                            generator=generator, min_p=self.r.min_p or 0.0)

    @contextmanager
    def timed(self, stats: dict, key: str):
        """Adds the seconds the block takes (the device's work included) to `stats[key]`, as TRL's perf/ metrics."""
        start = time.perf_counter()
        yield
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        stats[key] = stats.get(key, 0.0) + time.perf_counter() - start

    def _rewards(self, rows: list[dict], prompt_ids: list[list[int]], completions: list[list[int]]
                 ) -> tuple[torch.Tensor, dict]:
        """(the weighted reward of each completion, the mean and std of each function's and the reward model's);
        `prompt_ids` are the prompts' tokens, each once."""
        texts = [self.text.decode(ids) for ids in completions]
        repeated = [row for row in rows for _ in range(self.G)]
        prompts = [row.get("prompt", row.get("messages")) for row in repeated]
        columns = {k: [row.get(k) for row in repeated] for k in rows[0] if k not in ("prompt", "messages")}
        found = [torch.tensor(reward_funcs.call(fn, spec, prompts, texts, columns), dtype=torch.float32)
                 for spec, fn in self.funcs]
        names = [spec.rpartition(":")[2] for spec, _ in self.funcs]
        if self.reward_model is not None:
            found.append(self.reward_model([p for p in prompt_ids for _ in range(self.G)], completions).cpu())
            names.append(self.reward_model.name)
        scores = torch.stack(found).to(self.ctx.device)  # (functions, completions)
        stats = {}
        for name, row in zip(names, scores, strict=True):
            stats[f"rewards/{name}/mean"], stats[f"rewards/{name}/std"] = row.mean(), row.std()
        total = (scores * torch.tensor(self.weights, device=scores.device)[:, None]).sum(0)
        stats["reward"], stats["reward_std"] = total.mean(), total.std()
        return total, stats

    @torch.no_grad()
    def _generation_batch(self, batch: dict, accum: int) -> list:
        times: dict[str, float] = {}
        prompts, completions, total, reward_stats, old = self._generate_and_score(batch, times, accum)
        adv = self._advantages(total)
        micros, mask, self.real_tokens = self.micro_rows([p for p in prompts for _ in range(self.G)], completions,
                                                         accum)
        with self.timed(times, "perf/logps_s"):
            if old is None:
                old = self._logps(self.model, micros) if self.r.num_iterations > 1 else [None] * accum
            ref = self._logps(self.reference, micros) if self.reference is not None else [None] * accum
        self.reward_stats = {**reward_stats, **{k: torch.tensor(v, device=self.ctx.device) for k, v in times.items()}}
        return list(zip(micros, mask.chunk(accum), adv.chunk(accum), old, ref, strict=True))

    def _generate_and_score(self, batch: dict | None, times: dict, accum: int) -> tuple:
        """(prompts' tokens, completions, weighted rewards, reward statistics, the sampling policy's
        log-probabilities by micro-batch or None) of a generation batch: `batch`'s, or under
        recipe.generation.async the one sampled in the background; the seconds it takes go to `times`."""
        old = None
        if self.rollouts is not None:
            prompts, rows, completions, old = self.rollouts.take(accum, times)
        else:
            prompts, rows = self._prompts(batch)
            self.model.eval()
            with self.timed(times, "perf/generate_s"):
                completions = self._sample(prompts, self.generator)
            self.model.train()
        with self.timed(times, "perf/score_s"):
            total, stats = self._rewards(rows, prompts, completions)
        return prompts, completions, total, stats, old

    def _advantages(self, total: torch.Tensor) -> torch.Tensor:
        if self.r.scale_rewards != "batch":
            return advantages(total, self.G, self.r.scale_rewards)
        # The whole batch's std: every rank's rewards, one of each.
        return advantages(self.batch_wide(total), self.G, "batch").view(self.dp_size, -1)[self.dp_rank]

    def batch_wide(self, values: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's `values`, in rank order: gathered over the world, one of each group of peers
        holding the same rows (context- and tensor-parallel)."""
        everyone = [torch.empty_like(values) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, values)
        return torch.cat(everyone[:: self.ctx.dims.row_peers])

    def micro_rows(self, prompts: list[list[int]], completions: list[list[int]], accum: int
                   ) -> tuple[list[packing.Packed], torch.Tensor, int]:
        """`micro_rows` on this rank's device, as `data.packing` says."""
        return micro_rows(prompts, completions, self.text.pad, self.packing, accum, self.ctx.dims.sequence_multiple,
                          self.ctx.device)

    def token_logps(self, model, micro: packing.Packed) -> torch.Tensor:
        return token_logps(model, micro, self.logps_fn)

    def _logps(self, model, micros: list[packing.Packed], autocast=None) -> list[torch.Tensor]:
        out = []
        for micro in micros:
            with self.ctx.autocast if autocast is None else autocast:
                out.append(self.token_logps(model, micro))
        return out


def micro_rows(prompts: list[list[int]], completions: list[list[int]], pad: int, way: str, accum: int,
               multiple: int = 1, device: torch.device | None = None) -> tuple[list[packing.Packed], torch.Tensor, int]:
    """The `accum` micro-batches of the rows of prompts and their completions (`rows`), each collated as `way` (a
    `data.packing`) says, the (rows, width) mask of the completions' tokens, and the inputs that are not padding."""
    tokens, target, real = rows(prompts, completions, pad, multiple)
    tokens, target = tokens.to(device), target.to(device)
    micros = [packing.collate(*part, way, multiple)
              for part in zip(tokens.chunk(accum), target.chunk(accum), real.chunk(accum), strict=True)]
    return micros, target != IGNORE, int(real.sum())


def token_logps(model, micro: packing.Packed, loss_fn) -> torch.Tensor:
    """(rows, width) log p(target) of a micro-batch's rows under `model` (0 where no target counts)."""
    return packing.unpack(model(micro.tokens[:, :-1], micro.target, micro.inputs_documents, loss_fn=loss_fn), micro)


def rows(prompts: list[list[int]], completions: list[list[int]], pad: int, multiple: int = 1
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, targets, real input positions of each row): each row the prompt, its completion, then `pad` up to
    the longest row; the targets IGNORE but for the completion's tokens. The inputs' width is a multiple of
    `multiple` (`sequence_multiple`: tensor parallelism's sequence split, context parallelism's 2 x cp chunks)."""
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    width = -(-(longest - 1) // multiple) * multiple + 1
    tokens = torch.full((len(prompts), width), pad, dtype=torch.long)
    target = torch.full((len(prompts), width - 1), IGNORE, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[i, : len(p) + len(c)] = torch.tensor(p + c)
        target[i, len(p) - 1 : len(p) + len(c) - 1] = torch.tensor(c)
    real = torch.tensor([min(len(p) + len(c), width - 1) for p, c in zip(prompts, completions, strict=True)])
    return tokens, target, real
