"""The `recipe` section: which loss a run trains with (`recipe=pretrain|sft|dpo|kto|grpo|rloo|ppo|reward|kd`) and its
settings, with the rules of its own values. The rules that tie it to the data, the model and the batch are cross-section
rules (`trainer.config.across`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from omegaconf import MISSING

from trainer.config.checks import one_of, read_by, require

RECIPES = ("pretrain", "sft", "dpo", "kto", "grpo", "rloo", "reward", "kd", "ppo")
# The data each recipe trains on; a dataset of its own is for those recipes only.
DATA = {"sft": "chat", "dpo": "preference", "kto": "preference", "reward": "preference", "grpo": "prompts",
        "rloo": "prompts", "ppo": "prompts"}
ONLINE = ("grpo", "rloo")  # the recipes that sample groups of completions and score them
SAMPLING = (*ONLINE, "ppo")  # every recipe that samples completions and scores them (ppo: one a prompt)
KL_ESTIMATORS = ("k1", "k3")  # ppo: TRL's PPOConfig.kl_estimator
VALUE_MODELS = ("separate", "shared")  # ppo: a value model of its own, or a value head on the policy
DATA_ROWS = {"chat": "rows with messages",
             "preference": "rows with prompt, chosen, rejected; recipe=kto also prompt, completion, label",
             "prompts": "rows with a prompt (text) or messages"}
SCALE_REWARDS = ("group", "batch", "none")
# recipe.loss_type per recipe, TRL 1.16's names (GRPOConfig, DPOConfig, KTOConfig); conf/recipe/<name>.yaml sets
# TRL's default.
LOSS_TYPES = {"grpo": ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"),
              "dpo": ("sigmoid", "ipo", "hinge", "robust"), "kto": ("kto", "apo_zero_unpaired")}
IMPORTANCE_LEVELS = ("token", "sequence")
# grpo: the keys of the policy term each recipe.loss_type reads (TRL 1.16's `_compute_loss`); set off its default
# under a loss type that does not read it, a key is refused. cispo reads recipe.epsilon only while
# recipe.epsilon_high is null (TRL's epsilon_high falls back to it).
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the clipped ratio, each its own normalisation
LOSS_PARAMS = {**{t: ("epsilon", "epsilon_high", "delta") for t in CLIPPED}, "cispo": ("epsilon", "epsilon_high"),
               "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
               "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}
# grpo: the importance-sampling level a loss type must have (TRL warns on the other; LUSPO is GSPO's sequence-level
# loss, VESPO weighs whole sequences itself).
LOSS_LEVELS = {"luspo": "sequence", "vespo": "token"}
KD_LOSSES = ("forward_kl", "reverse_kl", "jsd")


@dataclass
class TeacherConfig:
    path: str | None = None  # kd: the teacher's Hugging Face directory (the student's tokenizer)


class GenerationConfig:
    """grpo, rloo: `recipe.generation.async=true` samples the next step's completions in the background, from a
    copy of the weights taken before this step's update, while this step trains (TRL's async GRPO with its
    staleness bound at one step). `async` is a Python keyword, so this dataclass is built by hand (no generated
    __init__, __repr__ or __eq__)."""

    def __init__(self, **values):
        setattr(self, "async", bool(values.get("async", False)))


GenerationConfig.__annotations__ = {"async": bool}
setattr(GenerationConfig, "async", False)
GenerationConfig = dataclass(init=False, repr=False, eq=False)(GenerationConfig)


def prompts_per_step(recipe, global_batch_size: int) -> tuple[int, str]:
    """(the prompts a step's batch of data holds, how that follows from the keys) under `recipe` (the section): grpo
    and rloo sample recipe.num_generations completions of each, ppo one of each for recipe.num_mini_batches steps."""
    if recipe.name == "ppo":
        return global_batch_size * recipe.num_mini_batches, "train.global_batch_size x recipe.num_mini_batches"
    return global_batch_size // recipe.num_generations, "train.global_batch_size / recipe.num_generations"


def is_async(recipe) -> bool:
    """Whether `recipe` (the section) asks for generation overlapping training."""
    return bool(getattr(recipe.generation, "async"))


@dataclass
class RewardModelConfig:
    # grpo, rloo: a reward model's Hugging Face directory (an exported recipe=reward run, a
    # *ForSequenceClassification with one label, the policy's tokenizer) scoring completions beside
    # recipe.reward_funcs; its weight comes after theirs in recipe.reward_weights.
    path: str | None = None


@dataclass
class KDConfig:
    # forward_kl: KL(teacher || student); reverse_kl: KL(student || teacher); jsd: the Jensen-Shannon divergence
    # (GKD's beta = 0.5), each at `temperature` and scaled by its square (Hinton et al.).
    loss: str = "forward_kl"
    temperature: float = 1.0  # the softmax temperature both models' logits are divided by
    alpha: float = 0.5  # the loss is alpha x the divergence + (1 - alpha) x the student's cross-entropy
    chunk_tokens: int = 1024  # tokens whose logits of both models are held at once


@dataclass
class RecipeConfig:
    # pretrain: next-token loss on every token; sft: only on the assistant's tokens of data=chat;
    # dpo: Direct Preference Optimization on data=preference against the frozen starting model;
    # kto: Kahneman-Tversky Optimization on data=preference's unpaired rows (or its pairs, unpaired as TRL does);
    # grpo: Group Relative Policy Optimization on data=prompts with reward functions;
    # kd: knowledge distillation from recipe.teacher on any data.
    name: str = MISSING
    # dpo, kto: how far from the reference the policy may move (the KL penalty's inverse weight); grpo: the KL
    # penalty's weight (0: no reference is held).
    beta: float = read_by("dpo", "kto", "grpo", "rloo", default=0.1)
    # grpo: grpo | bnpo | dr_grpo | dapo (TRL's default, set in conf/recipe/grpo.yaml) | luspo (the clipped ratio,
    # each normalised its own way) | cispo (the capped ratio as a weight) | sapo (a soft gate) | vespo (a gamma
    # weight per sequence); dpo: sigmoid (the default, conf/recipe/dpo.yaml) | ipo | hinge | robust; kto: kto (the
    # default, conf/recipe/kto.yaml) | apo_zero_unpaired. Each as TRL 1.16 computes it (trainer.recipes.grpo, .dpo,
    # .kto).
    loss_type: str | None = read_by("grpo", "dpo", "kto", default=None)
    # kto: the weights of the desirable (label true) and the undesirable completions' losses, to counter unequal
    # numbers of each (TRL's KTOConfig; the KTO paper's Eq. 8 bounds their ratio).
    desirable_weight: float = read_by("kto", default=1.0)
    undesirable_weight: float = read_by("kto", default=1.0)  # kto: the undesirable completions' losses' weight
    # dpo with loss_type=robust: the assumed share of flipped preference labels, in [0, 0.5).
    label_smoothing: float = read_by("dpo", default=0.0)
    # grpo: importance weights per token, or per completion (the mean of its tokens' log-ratios: GSPO); luspo must
    # have sequence, vespo token.
    importance_sampling_level: str = read_by("grpo", default="token")
    # grpo, rloo: completions per prompt (train.global_batch_size counts completions), the reward functions
    # (`package.module:function`, called with prompts=, completions= and the rows' other columns, returning a
    # float per completion) and their weights (null: 1 each), how advantages are scaled (group: by each
    # prompt's std; batch: the batch's; none), the clipping range (epsilon_high null: epsilon), the updates per
    # generation batch, and how completions are sampled.
    num_generations: int = read_by("grpo", "rloo", default=8)
    # grpo, rloo: the reward functions, package.module:function.
    reward_funcs: list[str] = read_by("grpo", "rloo", "ppo", default_factory=list)
    reward_weights: list[float] | None = read_by("grpo", "rloo", "ppo", default=None)
    # grpo: how advantages are scaled: group, batch or none.
    scale_rewards: str = read_by("grpo", "rloo", default="group")
    # The clipping range's lower side (and upper, without epsilon_high); grpo: loss types grpo, bnpo, dr_grpo, dapo,
    # luspo, and cispo while epsilon_high is null.
    epsilon: float = read_by("grpo", "rloo", default=0.2)
    # The clipping range's upper side (null: epsilon); grpo with loss_type=cispo: the cap of the ratio (ScaleRL's
    # epsilon_max, 5.0 recommended; null caps it at epsilon, as TRL does).
    epsilon_high: float | None = read_by("grpo", "rloo", default=None)
    # grpo with beta > 0: the KL term weighted by the importance ratio, so that its gradient is the unbiased
    # reverse-KL one off policy (DeepSeek-V3.2; TRL's default; it moves the gradient even on policy).
    use_bias_correction_kl: bool = read_by("grpo", default=True)
    # grpo, the clipped loss types: a cap on the unclipped ratio (INTELLECT-2's two-sided clipping; TRL recommends
    # above 1 + epsilon), null for none.
    delta: float | None = read_by("grpo", default=None)
    # grpo with loss_type=sapo: SAPO's soft gate sigmoid(tau (ratio - 1)) 4 / tau in place of clipping, its
    # temperature tau where the advantage is positive.
    sapo_temperature_pos: float = read_by("grpo", default=1.0)
    sapo_temperature_neg: float = read_by("grpo", default=1.05)  # sapo: the gate's temperature where A <= 0
    # grpo with loss_type=vespo: the gamma weight w^k e^(lambda (1 - w)) of each completion's ratio w (the product of
    # its tokens'), k for an advantage >= 0.
    vespo_k_pos: float = read_by("grpo", default=2.0)
    vespo_lambda_pos: float = read_by("grpo", default=3.0)  # vespo: lambda for an advantage >= 0
    vespo_k_neg: float = read_by("grpo", default=3.0)  # vespo: k for a negative advantage
    vespo_lambda_neg: float = read_by("grpo", default=2.0)  # vespo: lambda for a negative advantage
    num_iterations: int = read_by("grpo", "rloo", default=1)  # updates per generation batch
    max_completion_length: int = read_by("grpo", "rloo", "ppo", default=64)  # tokens sampled per completion at most
    temperature: float = read_by("grpo", "rloo", "ppo", default=1.0)  # sampling temperature
    top_k: int = read_by("grpo", "rloo", default=0)  # sample from the k likeliest tokens (0: every token)
    # Sample from the smallest set of tokens holding this probability.
    top_p: float = read_by("grpo", "rloo", default=1.0)
    min_p: float | None = read_by("grpo", "rloo", default=None)
    # rloo: scale advantages to mean 0 and std 1 over the generation batch.
    normalize_advantages: bool = read_by("rloo", default=False)
    reward_model: RewardModelConfig = read_by("grpo", "rloo", "ppo", default_factory=RewardModelConfig)
    generation: GenerationConfig = read_by("grpo", "rloo", default_factory=GenerationConfig)
    # reward: TRL's center_rewards_coefficient, the weight of the mean squared sum of a pair's rewards in the loss
    # (null: none), keeping the rewards centred on 0.
    center_rewards_coefficient: float | None = read_by("reward", default=None)
    # ppo: TRL's PPOConfig (the last release that ships it, 0.28), its names and defaults (conf/recipe/ppo.yaml sets
    # max_completion_length=53 and temperature=0.7, TRL's response_length and temperature): the PPO epochs over each
    # rollout batch, which holds num_mini_batches global batches (one optimizer step each), the reward scaled to mean
    # 0 and std 1 per rollout (whiten_rewards), the KL penalty's coefficient and estimator (k1: logp - ref; k3:
    # (ratio - 1) - log ratio), the policy's and the value's clipping ranges, the value loss's weight, GAE's discount
    # and lambda, the score subtracted from a completion that does not end with an end token (null: none), and the
    # value model (separate: its own model, from recipe.reward_model.path when given, else the policy's starting
    # weights with a fresh head; shared: a value head on the policy).
    num_ppo_epochs: int = read_by("ppo", default=4)
    num_mini_batches: int = read_by("ppo", default=1)
    whiten_rewards: bool = read_by("ppo", default=False)
    kl_coef: float = read_by("ppo", default=0.05)
    kl_estimator: str = read_by("ppo", default="k1")
    cliprange: float = read_by("ppo", default=0.2)
    vf_coef: float = read_by("ppo", default=0.1)
    cliprange_value: float = read_by("ppo", default=0.2)
    gamma: float = read_by("ppo", default=1.0)
    lam: float = read_by("ppo", default=0.95)
    missing_eos_penalty: float | None = read_by("ppo", default=None)
    value_model: str = read_by("ppo", default="separate")
    teacher: TeacherConfig = read_by("kd", default_factory=TeacherConfig)
    kd: KDConfig = read_by("kd", default_factory=KDConfig)

    def check(self) -> None:
        one_of("recipe", self.name, RECIPES)
        if self.name in LOSS_TYPES:
            one_of("recipe.loss_type", self.loss_type, LOSS_TYPES[self.name])
        else:
            require(self.loss_type is None, "recipe.loss_type", self.loss_type,
                    f"only recipe=grpo, recipe=dpo and recipe=kto read it (recipe={self.name}: leave it null)")
        require(self.label_smoothing == 0 or (self.name == "dpo" and self.loss_type == "robust"),
                "recipe.label_smoothing", self.label_smoothing,
                "only recipe=dpo with recipe.loss_type=robust reads it (TRL's other losses do not): leave it 0")
        require(0 <= self.label_smoothing < 0.5, "recipe.label_smoothing", self.label_smoothing, "must be in [0, 0.5)")
        require(self.importance_sampling_level == "token" or self.name == "grpo", "recipe.importance_sampling_level",
                self.importance_sampling_level, f"only recipe=grpo reads it (recipe={self.name}: leave it token)")
        if self.name in ("dpo", "kto"):
            require(self.beta > 0, "recipe.beta", self.beta, "must be > 0")
        if self.name == "kto":
            self._check_kto()
        if self.name in ONLINE:
            self._check_grpo()
        if self.name == "ppo":
            self._check_ppo()
        if self.name == "reward":
            require(self.center_rewards_coefficient is None or self.center_rewards_coefficient >= 0,
                    "recipe.center_rewards_coefficient", self.center_rewards_coefficient, "must be >= 0, or null")
        if self.name == "kd":
            self._check_kd()

    def _check_grpo(self) -> None:
        require(self.num_generations >= 2, "recipe.num_generations", self.num_generations,
                "must be >= 2 (advantages compare the completions of one prompt)")
        one_of("recipe.scale_rewards", self.scale_rewards, SCALE_REWARDS)
        one_of("recipe.importance_sampling_level", self.importance_sampling_level, IMPORTANCE_LEVELS)
        self._check_reward_weights()
        for key in ("epsilon", "num_iterations", "max_completion_length"):
            require(getattr(self, key) > 0, f"recipe.{key}", getattr(self, key), "must be > 0")
        require(self.epsilon_high is None or self.epsilon_high > 0, "recipe.epsilon_high", self.epsilon_high,
                "must be > 0, or null for recipe.epsilon")
        require(self.beta >= 0, "recipe.beta", self.beta, "must be >= 0 (0: no KL penalty, no reference held)")
        if self.name == "grpo":
            self._check_loss_type()
        require(self.temperature > 0, "recipe.temperature", self.temperature, f"must be > 0 ({self.name} samples)")
        require(self.top_k >= 0, "recipe.top_k", self.top_k, "must be >= 0 (0: every token)")
        require(0 < self.top_p <= 1, "recipe.top_p", self.top_p, "must be in (0, 1]")
        require(self.min_p is None or 0 <= self.min_p <= 1, "recipe.min_p", self.min_p, "must be in [0, 1], or null")
        require(not is_async(self) or self.num_iterations == 1, "recipe.generation.async", True,
                f"generates each step's completions during the step before; recipe.num_iterations="
                f"{self.num_iterations} reuses one generation batch for several steps: use recipe.num_iterations=1")

    def _check_loss_type(self) -> None:
        """grpo: the keys of recipe.loss_type's policy term have values it can take; those of the other loss types
        keep their defaults (TRL would leave them unread)."""
        kind = self.loss_type
        reads = ("epsilon_high",) if kind == "cispo" and self.epsilon_high is not None else LOSS_PARAMS[kind]
        defaults = {f.name: f.default for f in fields(self)}
        for key in dict.fromkeys(k for keys in LOSS_PARAMS.values() for k in keys):
            value, default = getattr(self, key), defaults[key]
            readers = "|".join(t for t, keys in LOSS_PARAMS.items() if key in keys)
            why = (f"only recipe.loss_type={readers} reads it (recipe.loss_type={kind})" if key not in LOSS_PARAMS[kind]
                   else f"recipe.loss_type={kind} reads it only while recipe.epsilon_high is null")
            require(key in reads or value == default, f"recipe.{key}", value,
                    f"{why}: leave it {'null' if default is None else default}")
        level = LOSS_LEVELS.get(kind, self.importance_sampling_level)
        require(self.importance_sampling_level == level, "recipe.importance_sampling_level",
                self.importance_sampling_level, f"recipe.loss_type={kind} takes {level} only (TRL warns on the other)")
        require(self.use_bias_correction_kl or self.beta > 0, "recipe.use_bias_correction_kl", False,
                "only recipe.beta > 0 reads it (the KL term it weighs): leave it true")
        require(self.delta is None or self.delta > 0, "recipe.delta", self.delta, "must be > 0, or null for no cap")
        for key in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            require(getattr(self, key) > 0, f"recipe.{key}", getattr(self, key), "must be > 0")

    def _check_reward_weights(self) -> None:
        rewards = len(self.reward_funcs) + bool(self.reward_model.path)
        require(self.reward_weights is None or len(self.reward_weights) == rewards,
                "recipe.reward_weights", None if self.reward_weights is None else list(self.reward_weights),
                f"must give one weight per reward function ({len(self.reward_funcs)})"
                + (" and one for recipe.reward_model" if self.reward_model.path else "") + ", or be null for 1 each")

    def _check_ppo(self) -> None:
        """ppo: TRL's PPOConfig's values in their ranges."""
        one_of("recipe.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        one_of("recipe.value_model", self.value_model, VALUE_MODELS)
        for key in ("num_ppo_epochs", "num_mini_batches", "cliprange", "cliprange_value", "max_completion_length",
                    "temperature"):
            require(getattr(self, key) > 0, f"recipe.{key}", getattr(self, key), "must be > 0")
        for key in ("kl_coef", "vf_coef"):
            require(getattr(self, key) >= 0, f"recipe.{key}", getattr(self, key), "must be >= 0")
        for key in ("gamma", "lam"):
            require(0 <= getattr(self, key) <= 1, f"recipe.{key}", getattr(self, key), "must be in [0, 1]")
        require(self.missing_eos_penalty is None or self.missing_eos_penalty > 0, "recipe.missing_eos_penalty",
                self.missing_eos_penalty, "must be > 0 (TRL: a positive value), or null for none")
        self._check_reward_weights()

    def _check_kto(self) -> None:
        """kto: both loss types read beta and the two weights (TRL 1.16's `_compute_loss`); no key is one loss
        type's alone, so none is refused for the loss type."""
        for key in ("desirable_weight", "undesirable_weight"):
            require(getattr(self, key) >= 0, f"recipe.{key}", getattr(self, key), "must be >= 0")
        require(self.desirable_weight + self.undesirable_weight > 0, "recipe.desirable_weight",
                self.desirable_weight, "and recipe.undesirable_weight are both 0, which weighs every loss to 0")

    def _check_kd(self) -> None:
        kd = self.kd
        one_of("recipe.kd.loss", kd.loss, KD_LOSSES)
        require(kd.temperature > 0, "recipe.kd.temperature", kd.temperature, "must be > 0")
        require(0 <= kd.alpha <= 1, "recipe.kd.alpha", kd.alpha, "must be in [0, 1]")
        require(kd.chunk_tokens > 0, "recipe.kd.chunk_tokens", kd.chunk_tokens, "must be > 0")
