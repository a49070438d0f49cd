"""TRL's PPOTrainer (0.28, the last release that ships `PPOTrainer`/`PPOConfig`) as the reference of recipe=ppo:
its own source, read from where that release is installed apart from the project's environment (`PLACE`: TRL
0.28 and TRL 1.16 cannot share one; `pip install --no-deps --target .trl-ppo trl==0.28.0`, which `.ci/run`
does). `PPOTrainer.train` computes the rollout's rewards, GAE and whitening and the loss inline; the blocks of its
source that do so are cut out by their first and last statements and run on given tensors, with TRL's own
`masked_mean`, `masked_var` and `masked_whiten`. Nothing of the loss is re-typed here. `PPOConfig`'s defaults are
read from its dataclass fields (the module is parsed, not imported: it subclasses transformers' TrainingArguments
of that release)."""

from __future__ import annotations

import ast
import glob
import os
import textwrap
from types import SimpleNamespace

import torch

VERSION = "0.28.0"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLACE = os.environ.get("TRL_PPO_PATH", os.path.join(REPO, ".trl-ppo"))
# What the rollout block and the loss block of `PPOTrainer.train` start and end with.
ROLLOUT = ("response_idxs = torch.arange(responses.shape[1]", "advantages = torch.masked_fill(advantages, padding_mask")
LOSS = ("vpredclipped = torch.clamp(", "loss = pg_loss + args.vf_coef * vf_loss")
STATS = ("pg_clipfrac = masked_mean(", "approxkl = 0.5 * (logprobs_diff**2).mean()")
INVALID_LOGPROB = 1.0  # TRL's trl.trainer.utils.INVALID_LOGPROB, what padding's log-probabilities are filled with


def source_dir() -> str | None:
    """trl/experimental/ppo of the reference release, or None where it is not installed (a `--target` folder or a
    virtualenv)."""
    for dist in [*glob.glob(os.path.join(PLACE, f"trl-{VERSION}.dist-info")),
                 *glob.glob(os.path.join(PLACE, "lib", "python3*", "site-packages", f"trl-{VERSION}.dist-info"))]:
        path = os.path.join(os.path.dirname(dist), "trl", "experimental", "ppo")
        if os.path.isfile(os.path.join(path, "ppo_trainer.py")):
            return path
    return None


def missing() -> str:
    return (f"TRL {VERSION}'s PPOTrainer is the reference: pip install --no-deps --target {PLACE} trl=={VERSION} "
            f"(or set TRL_PPO_PATH to a folder or virtualenv that holds it)")


def _read(name: str) -> str:
    with open(os.path.join(source_dir(), name)) as f:
        return f.read()


def _block(source: str, first: str, last: str) -> str:
    """The lines of `source` from the one that starts with `first` to the statement that starts with `last`,
    dedented (the statement's continuation lines included)."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first))
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith(last))
    while True:  # the last statement's continuation lines
        try:
            ast.parse(textwrap.dedent("\n".join(lines[start: end + 1])))
            break
        except SyntaxError:
            end += 1
    return textwrap.dedent("\n".join(lines[start: end + 1]))


def helpers() -> dict:
    """TRL's masked_mean, masked_var and masked_whiten (the module's own definitions)."""
    tree = ast.parse(_read("ppo_trainer.py"))
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("masked_")]
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "trl-ppo-helpers", "exec"), namespace)
    return namespace


def rollout(logprobs, ref_logprobs, values, scores, lengths, **args) -> dict:
    """TRL's step 3 to 6 of a rollout (padding masks, the KL penalty and the score in the rewards, their
    whitening, GAE, the advantages' whitening) on (completions, T) `logprobs`, `ref_logprobs`, `values` and
    (completions,) `scores` and `lengths` (each completion's tokens); `args`: PPOConfig's kl_estimator, kl_coef,
    whiten_rewards, gamma, lam. Returns the block's variables."""
    n, width = logprobs.shape
    space = {**helpers(), "args": SimpleNamespace(**args), "responses": torch.zeros(n, width, dtype=torch.long),
             "sequence_lengths": lengths - 1, "logprobs": logprobs, "ref_logprobs": ref_logprobs, "values": values,
             "scores": scores.clone(), "INVALID_LOGPROB": INVALID_LOGPROB, "empty_cache": lambda: None}
    exec(_block(_read("ppo_trainer.py"), *ROLLOUT), space)
    return space


def loss(new_logprobs, vpred, mb_logprobs, mb_values, mb_advantage, mb_return, padding_mask, padding_mask_p1,
         **args) -> dict:
    """TRL's loss of a micro-batch and its statistics (`loss`, `pg_loss`, `vf_loss`, `pg_clipfrac`, `vf_clipfrac`,
    `approxkl`, `ratio`), the policy's `new_logprobs` and the value model's `vpred` filled as TRL fills them;
    `args`: cliprange, cliprange_value, vf_coef."""
    n = new_logprobs.shape[0]
    space = {**helpers(), "args": SimpleNamespace(**args), "new_logprobs": new_logprobs, "vpred": vpred,
             "mb_logprobs": mb_logprobs, "mb_values": mb_values, "mb_advantage": mb_advantage, "mb_return": mb_return,
             "padding_mask": padding_mask, "padding_mask_p1": padding_mask_p1, "micro_batch_inds": torch.arange(n)}
    source = _read("ppo_trainer.py")
    exec(_block(source, *LOSS), space)
    with torch.no_grad():
        exec(_block(source, STATS[0], STATS[0]) + "\n" + _block(source, STATS[1], STATS[1]), space)
    return space


def config_defaults() -> dict:
    """PPOConfig's own fields and their defaults, from its dataclass (literal defaults only)."""
    tree = ast.parse(_read("ppo_config.py"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PPOConfig")
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call):
            for kw in node.value.keywords:
                if kw.arg == "default":
                    out[node.target.id] = ast.literal_eval(kw.value)
    return out
