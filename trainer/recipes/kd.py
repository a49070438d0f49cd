"""`recipe=kd`: knowledge distillation from a frozen teacher (`recipe.teacher.path`, a Hugging Face directory with
the student's tokenizer) on any data: each counted token's loss is

    alpha * T^2 * D(teacher || student at temperature T) + (1 - alpha) * cross-entropy(student, next token)

with D the forward KL, KL(p_t || p_s) (`recipe.kd.loss=forward_kl`), the reverse KL(p_s || p_t), or the
Jensen-Shannon divergence 0.5 KL(p_t || m) + 0.5 KL(p_s || m), m = (p_t + p_s) / 2 (TRL GKD's
`generalized_jsd_loss` at beta 0, 1 and 0.5), averaged over the counted tokens like recipe=sft's loss (data=chat:
the assistant's tokens; other data: every token). T^2 keeps the gradients' scale as T changes (Hinton et al.).

Neither model's logits exist whole: the teacher gives its final hidden states, the student its own inside its
forward (`loss_fn`, so that DDP and FSDP hooks see the loss), and the logits of both are made `recipe.kd.
chunk_tokens` tokens at a time, the student's recomputed in backward (`trainer.models.chunked`, the one chunking
of every recipe).
The teacher is placed like the student (`trainer.parallel.assembly`); its output matrix is gathered once."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from trainer.config import hf_impl
from trainer.models import unwrap
from trainer.models.chunked import capped, chunked
from trainer.parallel.assembly import assemble
from trainer.recipes.sft import IGNORE, SFT


def divergence(student: torch.Tensor, teacher: torch.Tensor, loss: str, temperature: float) -> torch.Tensor:
    """(tokens,) divergence of the teacher's and the student's distributions at `temperature`, times its square;
    logits (tokens, vocab)."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    if loss == "forward_kl":
        value = (t.exp() * (t - s)).sum(-1)
    elif loss == "reverse_kl":
        value = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logsumexp(torch.stack([s, t]), dim=0) - math.log(2)
        value = 0.5 * (t.exp() * (t - m)).sum(-1) + 0.5 * (s.exp() * (s - m)).sum(-1)
    return value * temperature**2


def _chunk(student: torch.Tensor, y: torch.Tensor, h_t: torch.Tensor, w_t: torch.Tensor, loss: str,
           temperature: float, teacher_softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens,) cross-entropies and divergences of a chunk: the student's logits, the teacher's made here."""
    with torch.no_grad():
        teacher = capped(F.linear(h_t, w_t), teacher_softcap)
    ce = F.cross_entropy(student.float(), y, reduction="none")
    return ce, divergence(student, teacher, loss, temperature)


def kd_loss(h_s: torch.Tensor, w_s: torch.Tensor, h_t: torch.Tensor, w_t: torch.Tensor, targets: torch.Tensor,
            loss: str = "forward_kl", temperature: float = 1.0, alpha: float = 0.5, chunk_tokens: int = 1024,
            softcap: float | None = None, teacher_softcap: float | None = None
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean distillation loss over the counted (not IGNORE) targets, and its two parts. h_s, h_t: (batch,
    seq, dim) hidden states of the student and the teacher; w_s, w_t their (vocab, dim) output matrices; softcap,
    teacher_softcap: the final logits' soft-caps of the two (Gemma 2), None where there is none."""
    counted = (targets != IGNORE).flatten()
    h_s, h_t, y = h_s.flatten(0, 1)[counted], h_t.flatten(0, 1)[counted], targets.flatten()[counted]
    n = max(int(y.numel()), 1)
    fn = functools.partial(_chunk, w_t=w_t, loss=loss, temperature=temperature, teacher_softcap=teacher_softcap)
    ce, div = chunked(fn, h_s, w_s, y, h_t, chunk_tokens=chunk_tokens, softcap=softcap)
    ce, div = ce.sum() / n, div.sum() / n
    total = alpha * div + (1 - alpha) * ce
    return total, {"kd/divergence": div.detach(), "kd/ce": ce.detach()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a sharded or sequence-split DTensor (tensor parallelism) gathered, differentiably."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class KD(SFT):
    def __init__(self, cfg, model, ctx):
        super().__init__(cfg, model, ctx)
        path = cfg.recipe.teacher.path  # the teacher runs natively or through transformers, as its directory says
        teacher_cfg = dataclasses.replace(cfg.model, name="hf", path=path, impl=hf_impl.choose(path, None)[0])
        self.teacher = assemble(teacher_cfg, cfg, ctx.dims, ctx.kernels, peft=False, qat=False, frozen=True)
        with torch.no_grad():
            self.teacher_weight = _whole(unwrap(self.teacher).output_weight).detach()
        k = cfg.recipe.kd
        self.settings = {"loss": k.loss, "temperature": k.temperature, "alpha": k.alpha, "chunk_tokens": k.chunk_tokens,
                         "teacher_softcap": getattr(unwrap(self.teacher), "final_softcap", None)}

    def _loss_fn(self, h_t: torch.Tensor, h_s: torch.Tensor, w_s: torch.Tensor, targets: torch.Tensor,
                 softcap: float | None = None):
        loss, stats = kd_loss(_whole(h_s), _whole(w_s), h_t, self.teacher_weight, targets, softcap=softcap,
                              **self.settings)
        self.add_stats(stats, 1 / self.cfg.train.grad_accum_steps)
        return loss

    def _forward(self, tokens: torch.Tensor, target: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        inputs = tokens[:, :-1]
        docs = documents[:, :-1].to(self.ctx.device) if documents is not None else None
        with torch.no_grad(), self.ctx.autocast:
            h_t = _whole(self.teacher(inputs, None, docs, loss_fn=lambda h, w, y, **_: h))
        with self.ctx.autocast:
            return self.model(inputs, target, docs, loss_fn=functools.partial(self._loss_fn, h_t))

    def eval_loss(self, batch: dict) -> torch.Tensor:
        with self.kept_stats():
            return super().eval_loss(batch)
