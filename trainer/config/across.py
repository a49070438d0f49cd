"""The rules that span sections, all of them, in one place: `check(job)` over the typed config, after each
section has checked its own values. Each helper below holds the rules of one pair of concerns."""

from __future__ import annotations

import importlib.util
import json
import os

from trainer.config import hf_impl, runtime
from trainer.config.checks import require
from trainer.config.degrees import Degrees
from trainer.config.families import BY_NAME
from trainer.config.model import BYTE_VOCAB_SIZE
from trainer.config.recipe import DATA, DATA_ROWS, ONLINE, SAMPLING, is_async
from trainer.config.runtime import JobShape
from trainer.config.strategy import MULTI_STAGE_SCHEDULES
from trainer.config.tracker import require_tracker_package
from trainer.errors import ConfigError
from trainjob import runtimes
from trainjob.run_files import RunDir
from trainjob.runtimes import RunFacts
from trainjob.storage.urls import is_url


def check(job, shape: JobShape) -> None:
    """Raise ConfigError on the first rule across sections that `job` (the typed `Config`) breaks. `shape`: the
    job's node counts, processes per node and degrees (`runtime.job_shape`), read once for every rule."""
    counts, per_node, dims, offers = shape.counts, shape.per_node, shape.dims, shape.offers
    gpus = runtime.local_gpus() if offers.gpus_per_node is None else 0
    _model_and_data(job, offers)
    _runtime(job, shape, gpus)
    _parallel(job, dims, runnable=not offers.runs_here or gpus > 0 or os.environ.get("TRITON_INTERPRET") == "1")
    _experts(job, dims)
    _recipe(job)
    _grpo(job)
    _reward(job)
    _kd(job)
    _peft(job)
    _qat(job)
    _trackers(job, offers)
    _batch_divides(job, dims)
    _kto(job, dims)
    _pipeline(job, dims)
    _context(job, dims)
    for nodes in counts[:-1]:  # an elastic job runs at any of its sizes
        _elastic_size(job, nodes, per_node * nodes)
    _checkpoint_dir(job)


def _checkpoint_dir(job) -> None:
    """Where checkpoints go, against the rest of the run: a fresh run overwrites none (a URL's store is asked once
    it is known to answer: `trainer.prepare.preflight`); DeepSpeed writes its own to local files only."""
    t = job.train
    remote = is_url(t.checkpoint_dir)
    require(not (remote and job.strategy.data_parallel == "deepspeed"), "train.checkpoint_dir", t.checkpoint_dir,
            "DeepSpeed writes its checkpoints to local files: give a local (shared) directory, or another strategy")
    if t.resume == "never" and not remote:
        ckpt = t.checkpoint_dir or RunDir.of(job.run_dir).checkpoints
        require(not (os.path.isdir(ckpt) and os.listdir(ckpt)), "train.resume", t.resume,
                f"{ckpt} already holds checkpoints that a fresh run would overwrite: use train.resume=auto "
                "or another run directory (or train.checkpoint_dir)")


def _runtime(job, shape: JobShape, gpus: int) -> None:
    """The runtime unit's rules on the rest of the run (`Runtime.check_run`; the unit looked up once, in
    `runtime.job_shape`), and the one rule of every runtime: a strategy that one runtime owns runs under it alone;
    as config errors. `gpus`: this machine's GPUs that the ranks take (0: not counted here)."""
    s, r = job.strategy, job.runtime
    with runtime.config_errors():
        runtimes.check_strategy(r.name if r is not None else None, s.name, s.data_parallel)
        if shape.unit is not None:
            shape.unit.check_run(r, RunFacts(
                counts=shape.counts, per_node=shape.per_node, gpus=gpus, strategy=s.name,
                data_parallel=s.data_parallel, checkpoint_async=bool(job.train.checkpoint_async),
                checkpoint_threads=job.train.checkpoint_threads,
                kubeflow_cache=job.data.cache.backend == "kubeflow", launcher=job.launcher.name), shape.offers)


def _batch_divides(job, dims: Degrees, nodes: int | None = None) -> None:
    t = job.train
    per_step = dims.dp_size * t.grad_accum_steps
    at = f" at {nodes} node(s) of runtime.nnodes={job.runtime.nnodes}" if nodes is not None else ""
    require(t.global_batch_size % per_step == 0, "train.global_batch_size", t.global_batch_size,
            f"must be divisible by data-parallel size x train.grad_accum_steps = {dims.dp_size} x "
            f"{t.grad_accum_steps} = {per_step}{at}")
    if job.recipe.name in ONLINE:  # each rank generates for whole prompts
        prompts = t.global_batch_size // job.recipe.num_generations
        require(prompts % dims.dp_size == 0, "train.global_batch_size", t.global_batch_size,
                f"/ recipe.num_generations={job.recipe.num_generations} gives {prompts} prompts a step, which "
                f"must be divisible by the data-parallel size {dims.dp_size} (each rank samples for its own "
                f"prompts){at}")


def _elastic_size(job, nodes: int, world: int) -> None:
    """An elastic job's rules at `nodes` nodes (`world` ranks): the same global batch must divide, the strategy
    must fit."""
    try:
        dims = Degrees.of(job.strategy, world)
    except ConfigError as e:
        raise ConfigError(e.key, e.value, f"{e.allowed} (at {nodes} node(s) of runtime.nnodes={job.runtime.nnodes}, "
                          f"world size {world})") from None
    _batch_divides(job, dims, nodes)
    _pipeline(job, dims, f" at {nodes} node(s) of runtime.nnodes={job.runtime.nnodes}")


def _model_and_data(job, offers) -> None:
    m = job.model
    # Chat and preference data are tokenized by the model directory's tokenizer, the rest byte by byte.
    own_tokenizer = job.data.name in ("chat", "preference") or (job.data.name == "prompts" and m.name == "hf")
    require(own_tokenizer or m.vocab_size >= BYTE_VOCAB_SIZE, "model.vocab_size",
            m.vocab_size, f"must be >= {BYTE_VOCAB_SIZE}, the byte-level tokenizer's vocabulary")
    require(job.data.seq_len <= m.max_seq_len, "data.seq_len", job.data.seq_len,
            f"must be <= model.max_seq_len={m.max_seq_len}")
    require(job.data.cache.backend != "kubeflow" or offers.kubeflow_cache, "data.cache.backend",
            job.data.cache.backend, f"Kubeflow Trainer's cache runs on Kubernetes: give launcher=kubernetes (not "
            f"{job.launcher.name}), or data.cache.backend=trainjob")


def _parallel(job, dims: Degrees, runnable: bool) -> None:
    """`runnable`: the Triton kernels can run where the job does (a GPU, or the interpreter)."""
    m, s = job.model, job.strategy
    if dims.tp > 1 and m.impl == "transformers":
        require(hf_impl.ships_tp_plan(m.path) is not False, "strategy", s.name,
                f"strategy={s.name} splits layers by a tensor-parallel plan; model.impl=transformers takes the one "
                f"its config class ships (base_model_tp_plan), and {m.path}'s has none: use strategy=ddp or fsdp2")
        require(not m.tie_embeddings, "strategy", s.name,
                f"model.path={m.path} ties its output layer to its embedding (tie_word_embeddings), which the "
                "tensor-parallel plan of model.impl=transformers splits by rows: use strategy=ddp or fsdp2")
    if dims.tp > 1:
        for key in ("n_heads", "n_kv_heads", "dim", "ffn_dim", *(("moe_ffn_dim",) if m.moe_ffn_dim else ())):
            require(getattr(m, key) % dims.tp == 0, f"model.{key}", getattr(m, key),
                    f"must be divisible by the tensor-parallel degree strategy.tp={dims.tp}")
    if job.optim.impl == "triton" and job.kernels.name != "triton":
        require(runnable, "optim.impl", "triton",
                "needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernel on the CPU (slowly, for testing)")
    if job.kernels.name == "triton":
        require(runnable, "kernels", "triton",
                "needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels on the CPU (slowly, for testing)")
        require(dims.tp == 1, "kernels", "triton", f"works with strategy=ddp or fsdp2 (strategy.tp=1); "
                f"strategy={s.name} hands the kernels DTensors")


PIPELINE_RECIPES = ("pretrain", "sft")
EXPERT_PARALLEL_RECIPES = ("pretrain", "sft")


def _experts(job, dims: Degrees) -> None:
    """Expert parallelism (strategy.ep > 1): a mixture of experts in our decoder, its experts split evenly."""
    if dims.ep == 1:
        return
    m = job.model
    require(m.n_experts > 0, "strategy.ep", dims.ep, f"splits a mixture of experts over ranks; model {m.name} has "
            "no experts (model.n_experts=0): use strategy.ep=1")
    require(m.n_experts % dims.ep == 0, "strategy.ep", dims.ep,
            f"must divide model.n_experts={m.n_experts}: each rank holds experts / ep of them")
    require(m.impl != "transformers", "strategy.ep", dims.ep, "model.impl=transformers runs transformers' own "
            "modeling code, whose experts trainjob does not split: use model.impl=native, or strategy.ep=1")
    require(job.recipe.name in EXPERT_PARALLEL_RECIPES, "recipe", job.recipe.name, f"strategy.ep={dims.ep} runs "
            f"recipes {', '.join(EXPERT_PARALLEL_RECIPES)}: use strategy.ep=1")


# The recipes whose losses context parallelism shares over the cp ranks: the next-token loss, and the recipes' own
# token losses over the gathered rows (WHOLE_ROWS). ppo, kto and reward cut their rows to no multiple of 2 x cp.
WHOLE_ROWS = ("dpo", "kd", "grpo", "rloo")
CONTEXT_RECIPES = ("pretrain", "sft", *WHOLE_ROWS)


def _context(job, dims: Degrees) -> None:
    """Context parallelism (strategy.cp > 1): rows cut into 2 x cp chunks, the native decoder's attention."""
    if dims.cp == 1:
        return
    require(not job.data.seq_len % (2 * dims.cp), "data.seq_len", job.data.seq_len, f"must be divisible by 2 x "
            f"strategy.cp = {2 * dims.cp} (context parallelism cuts each row into 2 x cp chunks)")
    require(job.model.impl != "transformers", "strategy.cp", dims.cp, "model.impl=transformers runs transformers' "
            "own attention, which does not exchange keys and values over ranks: use model.impl=native, or "
            "strategy.cp=1")
    require(job.recipe.name in CONTEXT_RECIPES, "recipe", job.recipe.name, f"strategy.cp={dims.cp} runs "
            f"{', '.join(CONTEXT_RECIPES)}; recipe={job.recipe.name} does not compose with context parallelism: "
            "use strategy.cp=1")
    require(dims.ep == 1, "strategy.ep", dims.ep, f"strategy.cp={dims.cp} splits each row's tokens over ranks that "
            "expert parallelism's all-to-all does not yet take together: use strategy.ep=1, or strategy.cp=1")
    require(dims.tp == 1 or job.recipe.name not in WHOLE_ROWS, "strategy.tp", dims.tp, f"recipe={job.recipe.name} "
            f"under strategy.cp={dims.cp} reads log-probabilities over whole rows, which tensor parallelism's sequence "
            "split does not give: use strategy.tp=1")


def _pipeline(job, dims: Degrees, at: str = "") -> None:
    """Pipeline parallelism (strategy.pp > 1): whole blocks per stage, a plain forward and loss per step, and
    enough micro-batches of the local batch to keep the stages busy."""
    if dims.pp == 1:
        return
    s, m, t = job.strategy, job.model, job.train
    require(job.data.packing in (None, "max_length"), "data.packing", job.data.packing,
            f"strategy.pp={dims.pp}: pipeline stages take micro-batches of one shape; use data.packing=max_length "
            "(or leave it unset)")
    require(job.recipe.name in PIPELINE_RECIPES, "recipe", job.recipe.name, f"strategy.pp={dims.pp} runs recipes "
            f"whose step is one forward and loss ({', '.join(PIPELINE_RECIPES)}); recipe={job.recipe.name} "
            "calls its model(s) otherwise: use strategy.pp=1")
    require(m.impl != "transformers", "strategy.pp", dims.pp, "model.impl=transformers runs transformers' own "
            "modeling code, whose model trainjob does not split into stages: use strategy.pp=1 (fsdp2 shards it), "
            "or a native family (model.impl=native)")
    require(not m.tie_embeddings, "strategy.pp", dims.pp, f"model {m.name} ties its output layer to the embedding, "
            "which would sit on the first and the last stage at once: pipeline parallelism needs untied "
            "embeddings (model.tie_embeddings=false), or strategy.pp=1")
    stages = dims.pp * s.stages_per_rank()
    points = list(s.pp_split_points)
    if points:
        require(len(points) == stages - 1 and all(0 < a < b for a, b in zip([0, *points], points, strict=False))
                and points[-1] < m.n_layers, "strategy.pp_split_points", points,
                f"must be {stages - 1} increasing block indices in 1..{m.n_layers - 1} (where stages 1..{stages - 1} "
                f"of {stages} begin: strategy.pp={dims.pp} x {s.stages_per_rank()} stage(s) per rank)")
    else:
        require(m.n_layers % stages == 0, "model.n_layers", m.n_layers, f"must be divisible by the {stages} "
                f"pipeline stages (strategy.pp={dims.pp} x {s.stages_per_rank()} per rank) for an even split; or "
                "give strategy.pp_split_points")
    micro = s.pp_microbatches or stages
    require(s.pp_schedule == "gpipe" or micro >= dims.pp, "strategy.pp_microbatches", micro,
            f"strategy.pp_schedule={s.pp_schedule} needs at least as many micro-batches as pipeline ranks "
            f"(strategy.pp={dims.pp})")
    rounds = max(1, micro // dims.pp)
    require(s.pp_schedule not in MULTI_STAGE_SCHEDULES or micro % rounds == 0, "strategy.pp_microbatches", micro,
            f"strategy.pp_schedule={s.pp_schedule} runs rounds of micro-batches // strategy.pp = {rounds}: the "
            f"micro-batches must be a multiple of {rounds}")
    local = t.global_batch_size // max(1, dims.dp_size * t.grad_accum_steps)
    require(local % micro == 0, "strategy.pp_microbatches", micro, f"must divide the local batch of {local} rows "
            f"(train.global_batch_size={t.global_batch_size} / (data-parallel size {dims.dp_size} x "
            f"train.grad_accum_steps={t.grad_accum_steps})){at}")


def _recipe(job) -> None:
    """The recipe, the data and the model fit together."""
    recipe, data = job.recipe.name, job.data.name
    require(recipe != "kd" or job.model.final_softcap is None, "recipe", recipe, "distils from logits it computes "
            "a chunk at a time from the hidden states, without the soft-capping of the model's final logits "
            f"(model.final_softcap={job.model.final_softcap}): use recipe=sft")
    require(recipe not in DATA or data == DATA[recipe], "data", data,
            f"recipe={recipe} trains on data={DATA.get(recipe)} ({DATA_ROWS.get(DATA.get(recipe))})")
    if data in DATA.values():
        wanted = [r for r, d in DATA.items() if d == data] + (["kd"] if data == "chat" else [])
        require(recipe in wanted, "recipe", recipe, f"data={data} is for recipe={' or recipe='.join(wanted)}")
        require(job.model.name == "hf" or data == "prompts", "model", job.model.name, f"data={data} tokenizes "
                "with the model directory's tokenizer and chat template: use model=hf model.path=<directory>")
        require(bool(job.data.path), "data.path", job.data.path,
                f"data={data} needs a JSONL file, or Parquet files, of its rows")
        c = job.data.cache
        require(not (c.endpoints or c.eval_endpoints or c.nodes), "data.cache", "set",
                f"data={data} is read from its local corpus; cache nodes serve "
                "token rows of data=stdlib or data=parquet only")


def _kto(job, dims: Degrees) -> None:
    """KTO's KL estimate pairs each prompt of a micro-batch with another row's completion, so a micro-batch holds
    more than one row (TRL's per_device_train_batch_size > 1); its completions are TRL's, whole."""
    if job.recipe.name != "kto":
        return
    t = job.train
    rows = t.global_batch_size // max(1, dims.dp_size * t.grad_accum_steps)
    require(job.recipe.loss_type != "kto" or rows > 1, "train.global_batch_size", t.global_batch_size,
            f"gives micro-batches of {rows} row (/ (data-parallel size {dims.dp_size} x train.grad_accum_steps="
            f"{t.grad_accum_steps})): recipe.loss_type=kto estimates its KL term from the mismatched pairs of a "
            "micro-batch, which needs at least 2 rows (TRL's per_device_train_batch_size > 1)")
    require(job.data.chat.mask == "assistant", "data.chat.mask", job.data.chat.mask, "recipe=kto counts each "
            "completion's tokens as TRL's KTOTrainer does (all that follows the prompt): leave it assistant")


PPO_DATA_PARALLEL = ("ddp", "fsdp")  # where recipe=ppo trains its value model beside the policy


def _grpo(job) -> None:
    """GRPO's, RLOO's and PPO's completions fill the global batch, each fits the model after its prompt, and
    something scores them."""
    r, t = job.recipe, job.train
    if r.name not in SAMPLING:
        require(not r.reward_model.path, "recipe.reward_model.path", r.reward_model.path,
                f"scores completions of recipe=grpo, rloo or ppo; recipe={r.name} samples none")
        return
    require(bool(r.reward_funcs) or bool(r.reward_model.path), "recipe.reward_funcs", list(r.reward_funcs),
            f"recipe={r.name} needs at least one reward function, as package.module:function, or "
            "recipe.reward_model.path")
    # imports the user's modules (they read the data's columns); no torch
    from trainer.rewards import functions as reward_funcs

    for spec in r.reward_funcs:
        reward_funcs.load(spec)
    require(job.data.seq_len + r.max_completion_length <= job.model.max_seq_len, "recipe.max_completion_length",
            r.max_completion_length, f"data.seq_len={job.data.seq_len} (the longest prompt) plus this must be <= "
            f"model.max_seq_len={job.model.max_seq_len}")
    if r.reward_model.path:
        _reward_model(job)
    if r.name == "ppo":
        dp = job.strategy.data_parallel
        require(dp in PPO_DATA_PARALLEL, "strategy.data_parallel", dp,
                f"recipe=ppo trains its value model beside the policy under {' or '.join(PPO_DATA_PARALLEL)}")
        return
    require(t.global_batch_size % r.num_generations == 0, "recipe.num_generations", r.num_generations,
            f"must divide train.global_batch_size={t.global_batch_size} (which counts completions: "
            "num_generations of each prompt)")
    require(not is_async(r) or job.strategy.name == "ddp", "recipe.generation.async", True,
            f"samples in a background thread from a copy of the whole weights; strategy={job.strategy.name} shards "
            "them, so every forward is collective across ranks: use strategy=ddp")


def _reward(job) -> None:
    """recipe=reward trains a score head on the whole model; only it starts from a classifier's directory."""
    m, name = job.model, job.recipe.name
    if m.name == "hf" and m.impl != "transformers" and m.path and os.path.isfile(os.path.join(m.path, "config.json")):
        from trainer.config import hf

        require(name == "reward" or not hf.is_classifier(hf.read_config(m.path)), "model.path", m.path,
                f"holds a *ForSequenceClassification model (a reward model): recipe={name} trains a causal LM; "
                "a reward model trains with recipe=reward, or scores with recipe.reward_model.path")
    if name != "reward":
        return
    require(m.impl != "transformers", "model.impl", m.impl, "recipe=reward puts its score head on trainjob's own "
            "decoder: a native family's directory (model.impl=native)")
    require(job.strategy.tp == 1, "strategy", job.strategy.name, "recipe=reward's score head has one output, "
            "which tensor parallelism cannot split over ranks: use strategy=ddp or fsdp2")
    require(job.peft.name == "none", "peft", job.peft.name, "recipe=reward trains a new score head, which "
            "peft=lora would leave frozen: use peft=none")


def _reward_model(job) -> None:
    """A reward model scores the policy's token ids: a one-label classifier with the policy's tokenizer."""
    from trainer.config import hf  # reads config.json only

    r, m, key = job.recipe, job.model, "recipe.reward_model.path"
    path = r.reward_model.path
    require(os.path.isfile(os.path.join(path, "config.json")), key, path,
            "must be a Hugging Face model directory holding config.json (python -m trainer.export of a "
            "recipe=reward run writes one)")
    config = hf.read_config(path, key=key)
    require(hf.is_classifier(config) and hf.num_labels(config) == 1, key, path, "must hold a "
            f"*ForSequenceClassification model with one label; it holds {config['architectures'][0]} with "
            f"{hf.num_labels(config)} label(s)")
    scorer = hf.settings(path)
    require(scorer["vocab_size"] == m.vocab_size, key, path, f"its vocabulary has {scorer['vocab_size']} tokens, "
            f"the policy's model.vocab_size={m.vocab_size}: it scores the policy's token ids, so both need the "
            "same tokenizer")
    mine = os.path.join(m.path, "tokenizer.json") if m.name == "hf" else None
    theirs = os.path.join(path, "tokenizer.json")
    require(not (mine and os.path.isfile(mine) and os.path.isfile(theirs)) or _vocab(mine) == _vocab(theirs), key,
            path, f"its tokenizer.json maps tokens to other ids than model.path={m.path}'s: it scores the policy's "
            "token ids, so both need the same tokenizer")
    longest = job.data.seq_len + r.max_completion_length
    require(scorer["max_seq_len"] >= longest, key, path, f"it holds {scorer['max_seq_len']} positions, fewer "
            f"than data.seq_len + recipe.max_completion_length = {longest}")


def _kd(job) -> None:
    """A KD teacher shares the student's tokenizer and holds the sequence length."""
    if job.recipe.name != "kd":
        return
    path = job.recipe.teacher.path
    require(bool(path) and os.path.isfile(os.path.join(path, "config.json")), "recipe.teacher.path", path,
            "recipe=kd needs the teacher's Hugging Face model directory (holding config.json)")
    # A directory trainjob can load (natively or through transformers), or refused naming the key.
    _, teacher = hf_impl.read(path, "recipe.teacher.path")
    m = job.model
    require(teacher["vocab_size"] == m.vocab_size, "recipe.teacher.path", path,
            f"the teacher has a vocabulary of {teacher['vocab_size']} tokens, the student model.vocab_size="
            f"{m.vocab_size}: distillation compares their distributions token by token, so both need the same "
            "tokenizer")
    mine = os.path.join(m.path, "tokenizer.json") if m.name == "hf" else None
    theirs = os.path.join(path, "tokenizer.json")
    require(not (mine and os.path.isfile(mine) and os.path.isfile(theirs)) or _vocab(mine) == _vocab(theirs),
            "recipe.teacher.path", path, f"its tokenizer.json maps tokens to other ids than model.path={m.path}'s: "
            "distillation needs the same tokenizer")
    require(teacher["max_seq_len"] >= job.data.seq_len, "recipe.teacher.path", path,
            f"the teacher holds {teacher['max_seq_len']} positions, fewer than data.seq_len={job.data.seq_len}")


def _vocab(tokenizer_json: str) -> dict:
    with open(tokenizer_json) as f:
        return json.load(f).get("model", {}).get("vocab", {})


def _qat(job) -> None:
    """Quantization-aware training fake-quantises the model's own, whole linear layers in PyTorch."""
    t, m = job.train, job.model
    if t.qat == "none":
        return
    for key in ("dim", "ffn_dim"):  # every linear layer's input width is one of these
        require(getattr(m, key) % t.qat_group_size == 0, "train.qat_group_size", t.qat_group_size,
                f"must divide model.{key}={getattr(m, key)} (weights are quantised in groups along each row)")
    require(job.peft.name == "none", "train.qat", t.qat, "fake-quantises the model's own linear layers; with "
            f"peft={job.peft.name} they are frozen and the adapters beside them stay unquantised: use peft=none")
    require(job.kernels.name != "triton", "train.qat", t.qat, "fake-quantises the linear layers in PyTorch; "
            "kernels=triton fuses the output layer into its loss, which would skip it: use kernels=torch")
    require(job.strategy.tp == 1, "train.qat", t.qat, "torchao's fake quantisation takes whole weights; "
            f"strategy={job.strategy.name} splits them over tensor-parallel ranks: use strategy=ddp or fsdp2")
    require(importlib.util.find_spec("torchao") is not None, "train.qat", t.qat,
            "needs torchao: pip install 'trainjob[qat]'")


def _peft(job) -> None:
    """LoRA adapts a pretrained model."""
    if job.peft.name != "none":
        require(job.model.name == "hf", "peft", job.peft.name,
                f"LoRA adapts a pretrained model: use model=hf model.path=<directory> "
                f"(model is {job.model.name}, whose frozen weights would be random)")
        # Through transformers any module name of the model is a target (the ranks check that it names one).
        if job.model.impl == "transformers":
            return
        family = BY_NAME[job.model.family]
        targets = list(job.peft.target_modules)
        require(all(t in family.lora_targets for t in targets), "peft.target_modules", targets,
                f"a {family.name} model has {', '.join(family.lora_targets)} (model.impl=native)")


def _trackers(job, offers) -> None:
    """Where the ranks run on this machine, a tracker's package must be installed here."""
    if offers.runs_here:
        for name in job.tracker.report_to:
            require_tracker_package(name, list(job.tracker.report_to))
