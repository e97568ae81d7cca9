"""Parallel denoising of the Wan2.1 transformer across a collaboration group (issue 13).

A step of a batch runs on a group of ranks (its degree of parallelism, DoP) in one of two
ways, combined when the DoP allows both:

- **CFG-parallel**: the conditional and the unconditional halves of a guided batch run on two
  halves of the group, and the group gathers both;
- **sequence-parallel**: diffusers' own context parallelism (Ulysses: an all-to-all over heads)
  through the transformer's ``_cp_plan``, over the group's mesh.

Every rank of the instance keeps a replica of every request's state (latents and its own
diffusers scheduler). Every step's guided noise reaches every rank (at the end of the run the
step belongs to), and each rank applies the scheduler step itself, so the replicas stay
identical and a request can change its DoP between any two runs: moving between layouts costs
nothing but the next step's layout.

diffusers' ``enable_parallelism`` cannot be used as it is: it picks the device as ``rank %
torch.accelerator.device_count()``, which divides by zero on CPU, and it attaches context
parallelism for good, where the DoP here changes between steps. ``_SequenceParallel`` does
what it does (``ParallelConfig.setup``, the processors' config, ``apply_context_parallel``)
on meshes built once, and detaches it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from onepiece.sched.ranks import Ranks
from onepiece.stage.collective import Collective
from onepiece.stage.gpu import synchronizer


@dataclass(frozen=True)
class Layout:
    """How ``ranks`` share one step: ``cfg`` halves (1 or 2), each of ``len(ranks) // cfg``
    ranks in sequence parallel."""

    ranks: Ranks
    cfg: int

    @property
    def sp(self) -> int:
        return len(self.ranks) // self.cfg

    def half(self, rank: int) -> Ranks:
        """The ranks that run ``rank``'s CFG half together."""
        i = self.ranks.index(rank) // self.sp
        return self.ranks[i * self.sp:(i + 1) * self.sp]


def layout(ranks: Ranks, cfg: bool) -> Layout:
    """CFG-parallel first (no communication inside the forward pass), sequence-parallel for the
    rest of the ranks."""
    return Layout(tuple(ranks), 2 if cfg and len(ranks) % 2 == 0 else 1)


def _divides(sp: int, model: Any, hidden_states: torch.Tensor) -> bool:
    """Ulysses splits the tokens over the ranks and then the heads: both must divide."""
    p_t, p_h, p_w = model.config.patch_size
    _, _, f, h, w = hidden_states.shape
    tokens = (f // p_t) * (h // p_h) * (w // p_w)
    return model.config.num_attention_heads % sp == 0 and tokens % sp == 0


class _SequenceParallel:
    """diffusers' context parallelism for one model, attached per mesh on demand."""

    def __init__(self, collective: Collective) -> None:
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

        self.configs: dict[Ranks, Any] = {}
        for ranks, mesh in collective.meshes.items():
            if collective.rank in ranks:
                cp = ContextParallelConfig(ulysses_degree=len(ranks), mesh=mesh)
                config = ParallelConfig(context_parallel_config=cp)
                config.setup(collective.rank, collective.size, collective.device, mesh=mesh)
                self.configs[ranks] = config
        self.attached: dict[int, tuple[Any, Ranks]] = {}  # id(model) -> (model, ranks)

    def attach(self, model: Any, ranks: Ranks | None) -> None:
        """Make ``model`` run sequence-parallel over ``ranks`` (None: alone)."""
        from diffusers.hooks.context_parallel import apply_context_parallel, remove_context_parallel

        current = self.attached.get(id(model), (model, None))[1]
        if current == ranks:
            return
        if current is not None:
            remove_context_parallel(model, model._cp_plan)
            self._processors(model, None)
            del self.attached[id(model)]
        if ranks is not None:
            config = self.configs[ranks]
            self._processors(model, config)
            apply_context_parallel(model, config.context_parallel_config, model._cp_plan)
            self.attached[id(model)] = (model, ranks)

    @staticmethod
    def _processors(model: Any, config: Any) -> None:
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = config


class ParallelDenoiser:
    """Runs steps of WanDenoise batches on groups of the instance's ranks."""

    def __init__(self, collective: Collective) -> None:
        self.c = collective
        self.sp = _SequenceParallel(collective)
        self.sync = synchronizer(collective.device)

    def forward(self, ranks: Ranks) -> Any:
        """A ``forward(model, cfg, **inputs)`` for ``WanDenoise.predict`` that runs on
        ``ranks`` (this rank among them) and leaves the whole output on each of them."""

        def run(model: Any, cfg: bool, **inputs: Any) -> torch.Tensor:
            lay = layout(ranks, cfg)
            if lay.cfg == 2:  # this rank's half of the batch: conditional first
                n = inputs["hidden_states"].shape[0] // 2
                i = lay.ranks.index(self.c.rank) // lay.sp
                inputs = {k: v[i * n:(i + 1) * n] for k, v in inputs.items()}
            half = lay.half(self.c.rank)
            sp = half if len(half) > 1 and _divides(len(half), model, inputs["hidden_states"]) else None
            self.sp.attach(model, sp)
            out = model(**inputs, attention_kwargs=None, return_dict=False)[0]
            if lay.cfg == 1:  # gathered by the sequence-parallel output hook, or computed whole here
                return out
            parts = [torch.empty_like(out) for _ in ranks]
            dist.all_gather(parts, out.contiguous(), group=self.c.group(ranks))
            return torch.cat([parts[0], parts[lay.sp]])

        return run

    def run(self, parts: list[tuple[Ranks, list[Any], int]],
            leave_out: Callable[[int], set[int]] | None = None) -> list[tuple[list[list[int]], float]]:
        """Each part (ranks, tasks, steps) advances its tasks up to ``steps`` steps on its ranks,
        the parts independently of each other (disjoint ranks); then every part's noise of every
        step is handed to the ranks that did not compute it, which apply the same scheduler
        steps, so all replicas stay equal. Every rank calls this with the same ``parts``.

        ``leave_out(i)``: called on every rank before each step of a part that spans the whole
        world (a collective may run in it), the indices of part ``i``'s tasks that step no more
        (cancelled meanwhile). A part on fewer ranks is not asked: its ranks step apart from the
        others, and the replay must repeat its steps exactly.

        Returns per part: the indices of its tasks that stepped at each step, and the seconds
        its ranks took (the slowest of them)."""
        live_at: list[list[list[int]]] = [[] for _ in parts]
        noises: list[list[torch.Tensor]] = [[] for _ in parts]
        took = torch.zeros(len(parts), dtype=torch.float64)
        with torch.inference_mode():
            for i, (ranks, tasks, steps) in enumerate(parts):
                if self.c.rank not in ranks:
                    continue
                t0 = time.perf_counter()
                forward = self.forward(ranks)
                gone: set[int] = set()
                for _ in range(steps):
                    if leave_out is not None and len(ranks) == self.c.size:
                        gone |= leave_out(i)
                    live = [j for j, t in enumerate(tasks) if not t.done and j not in gone]
                    if not live:
                        break
                    batch = [tasks[j] for j in live]
                    noise = type(batch[0]).predict(batch, forward)
                    type(batch[0]).advance(batch, noise)
                    live_at[i].append(live)
                    noises[i].append(noise)
                self.sync()
                took[i] = time.perf_counter() - t0
            for i, (ranks, tasks, steps) in enumerate(parts):
                if len(ranks) == self.c.size:
                    continue  # every rank computed it
                mine = self.c.rank in ranks
                for k in range(steps):  # the others replay it in the same order
                    if mine:
                        if k >= len(noises[i]):
                            break
                        dist.broadcast(noises[i][k], ranks[0])
                        continue
                    live = [j for j, t in enumerate(tasks) if not t.done]
                    if not live:
                        break
                    batch = [tasks[j] for j in live]
                    t = batch[0]
                    noise = torch.empty((len(batch), *t.latents.shape[1:]), dtype=t.dtype,
                                        device=t.latents.device)
                    dist.broadcast(noise, ranks[0])
                    type(t).advance(batch, noise)
                    live_at[i].append(live)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=self.c.cpu)
        return [(live_at[i], float(took[i])) for i in range(len(parts))]
