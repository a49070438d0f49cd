"""Pipeline parallelism (`strategy.pp`), built as TorchTitan builds it (`distributed/pipeline_parallel.py`) on
`torch.distributed.pipelining`: the meta model is deep-copied once per stage this rank runs and pruned to that
stage's blocks (the embedding stays on the first stage, the norm and output layer on the last), each copy is
parallelized like a whole model (TP, activation checkpointing, compile, FSDP2), and a `PipelineStage` per copy
runs under one of the schedules `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`.

Every copy keeps the unsplit model's names (`layers.5.attention.wq.weight` is stage 1's and still called so),
and `StagedModel` shows this rank's stages as one module under those names: the optimizer, clipping,
initialisation and checkpoints see a model that holds some of the blocks, and DCP merges the ranks' keys into
the unsplit model's checkpoint, which loads under any other strategy, and back.

The loss is computed on the last stage from the logits (summed over the targets, scaled to the step's mean, so
that micro-batches with different numbers of counted tokens weigh each token alike), and every rank of the
pipeline gets it back. `Pipeline.run` is what the recipe calls instead of the model's forward and backward.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

IGNORE = -100  # the targets cross-entropy skips (trainer.recipes.sft's)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def stage_layers(n_layers: int, stages: int, split_points: list[int]) -> list[range]:
    """The block indices of each stage: from `split_points` (where stages 1.. begin), or an even split."""
    starts = [0, *split_points] if split_points else [i * n_layers // stages for i in range(stages)]
    return [range(a, b) for a, b in zip(starts, [*starts[1:], n_layers], strict=True)]


def stage_ids(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages rank `pp_rank` runs: one, or for interleaved schedules one per round ("loop" order)."""
    return [pp_rank + round_ * pp for round_ in range(per_rank)]


def split(model: nn.Module, stage: int, layers: range, stages: int) -> nn.Module:
    """A copy of the meta `model` holding only stage `stage`'s part, under the unsplit model's names."""
    part = copy.deepcopy(model)
    for name in list(part.layers.keys()):
        if int(name) not in layers:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != stages - 1:
        part.norm, part.output, part.tied_output = None, None, None
    return part


class StagedModel(nn.Module):
    """This rank's pipeline stages seen as one model, under the unsplit model's names (its parts' modules, not
    the parts themselves, are its children). Its `pipeline` runs them; it has no forward of its own."""

    def __init__(self, parts: list[nn.Module], pipeline: Pipeline):
        super().__init__()
        object.__setattr__(self, "parts", parts)  # not children: their names would prefix the modules'
        self.pipeline = pipeline
        self.family = parts[0].family  # the checkpoint layout every part shares (`trainer.models.hf`)
        for name in ("tok_embeddings", "norm", "output"):
            found = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            if found:
                self.add_module(name, found[0])
        self.layers = nn.ModuleDict({k: v for p in parts for k, v in p.layers.items()})

    def train(self, mode: bool = True) -> StagedModel:
        for part in self.parts:
            part.train(mode)
        return super().train(mode)

    def init_buffers(self) -> None:
        for part in self.parts:
            part.init_buffers()

    def forward(self, *args, **kwargs):
        raise TypeError("a pipelined model runs through its schedule: call model.pipeline.run(...)")


class Pipeline:
    """The schedule over this rank's stages, and the loss it computes on the last one."""

    def __init__(self, parts: list[nn.Module], ids: list[int], stages: int, microbatches: int, schedule: str,
                 group, device: torch.device):
        self.group, self.device = group, device
        self.stages = [PipelineStage(part, i, stages, device, group=group) for part, i in zip(parts, ids, strict=True)]
        self.first, self.last = 0 in ids, stages - 1 in ids
        self.factor = 1.0  # the loss's scale for the step in flight (see `run`)
        cls = SCHEDULES[schedule]
        target = self.stages if cls is ScheduleInterleaved1F1B else self.stages[0]
        # Gradients are not averaged over micro-batches by the schedule: `_loss` gives each its share.
        self.schedule = cls(target, microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(0, 1), ignore_index=IGNORE,
                                 reduction="sum")
        return summed * self.factor

    def run(self, inputs: torch.Tensor, target: torch.Tensor, documents: torch.Tensor | None, scale,
            backward: bool) -> torch.Tensor:
        """The mean loss over `target`'s counted tokens, times `scale`, on every rank of the pipeline (detached);
        with `backward`, the gradients of the stages' parameters accumulate it, as the loss's backward would."""
        counted = (target != IGNORE).sum().clamp(min=1)
        self.factor = scale / counted
        kwargs = {} if documents is None else {"documents": documents.to(self.device)}
        args = (inputs,) if self.first else ()
        losses: list[torch.Tensor] = []
        if backward:
            self.schedule.step(*args, target=target, losses=losses, **kwargs)
        else:
            self.schedule.eval(*args, target=target, losses=losses, **kwargs)
        total = torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=self.device)
        dist.all_reduce(total, group=self.group)  # from the last stage to every stage
        return total

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """A sum over the pipeline's ranks (of what each holds of the stages')."""
        value = value.clone()
        dist.all_reduce(value, group=self.group)
        return value
