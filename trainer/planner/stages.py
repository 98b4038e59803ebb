"""Pipeline stages on paper: each card's memory when the transformer's blocks are split into contiguous
stages across cards, and what crosses between them per step against FSDP and block swap.

A split puts blocks ``[lo, hi)`` on each card (balanced by the blocks' parameters, which set both their
weights and their FLOPs per token); the layers outside the blocks (embedders, final norm and projection)
sit on the first and the last stage. Under a 1F1B schedule (``torch.distributed.pipelining.Schedule1F1B``)
stage ``k`` of ``S`` holds the activations of at most ``S - k`` micro-batches at once (GPipe: all ``M``),
and only the hidden states at each boundary cross the link: forward activations and their gradients back.

The stage plan reuses ``build_plan`` on the stage's share of the model: the same items, counted for the
stage's blocks and its micro-batches in flight (their activations counted as one batch of that many samples:
a slight over-estimate of the recomputation and backward buffers, which are per micro-batch). The cache pass
is counted on every card as on one (each card may encode); validation renders are left out (a render needs
every stage).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from trainer.planner.model_sizes import BlockKind, ModelSizes, TransformerSizes
from trainer.planner.plan import transformer_weight_bytes, build_plan
from trainer.planner.report import MemoryPlan
from trainer.planner.settings import GIB, Settings

# Sustained host<->device and card-to-card copy rates over a x16 link without NVLink (GB/s, 10^9 B/s): about
# 80% of PCIe 4.0's 31.5 and PCIe 5.0's 63 GB/s per direction, what pinned copies reach in practice.
PCIE_GBPS = {"PCIe 4.0 x16": 25.0, "PCIe 5.0 x16": 50.0}


@dataclass(frozen=True)
class StagePlan:
    """One card of a pipeline split: its blocks, its micro-batches in flight, and its memory plan."""

    index: int
    blocks: Tuple[int, int]  # [lo, hi) in execution order
    in_flight: int  # micro-batches whose activations it holds at once (1F1B)
    plan: MemoryPlan


@dataclass(frozen=True)
class Traffic:
    """Bytes one step moves over the links, per card, for each way of fitting the model."""

    pipeline: float  # hidden states forward and their gradients back, at every boundary, per micro-batch
    fsdp: float  # the frozen weights all-gathered for the forward and again for the backward
    block_swap: Optional[float]  # one card: the swapped blocks copied in for the forward and the backward
    swapped_blocks: Optional[int]  # how many blocks one card of this budget must swap (None: none fits)
    bubble: float  # the idle fraction of a pipeline step: (S - 1) / (M + S - 1)

    def seconds(self, gbps: float) -> Tuple[float, float, Optional[float]]:
        """(pipeline, FSDP, block swap) seconds per step at ``gbps`` GB/s."""
        rate = gbps * 1e9
        return (self.pipeline / rate, self.fsdp / rate,
                None if self.block_swap is None else self.block_swap / rate)


def split_blocks(t: TransformerSizes, stages: int) -> List[Tuple[int, int]]:
    """Contiguous ``[lo, hi)`` block ranges, one per stage, with about equal parameters in each."""
    if not 1 <= stages <= t.num_blocks:
        raise ValueError(f"pipeline stages: {stages} must be between 1 and the {t.num_blocks} blocks")
    return split_by_sizes([t.block_at(i).params for i in range(t.num_blocks)], stages)


def split_by_sizes(sizes: Sequence[int], stages: int) -> List[Tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges of ``sizes`` (the blocks' parameters, in execution order), one per
    stage, with about equal sums: the split the planner prints and the training stages use."""
    if not 1 <= stages <= len(sizes):
        raise ValueError(f"pipeline stages: {stages} must be between 1 and the {len(sizes)} blocks")
    total, bounds, running = sum(sizes), [0], 0
    for i, size in enumerate(sizes):
        running += size
        # close a stage where the running total is nearest its share, leaving a block for each stage after it
        if len(bounds) < stages and running >= total * len(bounds) / stages - size / 2 \
                and len(sizes) - (i + 1) >= stages - len(bounds):
            bounds.append(i + 1)
    bounds.append(len(sizes))
    return list(zip(bounds[:-1], bounds[1:]))


def stage_transformer(t: TransformerSizes, lo: int, hi: int, outer: bool) -> TransformerSizes:
    """The share of ``t`` one stage holds: blocks ``[lo, hi)``, and the outer layers when ``outer``."""
    kinds: List[BlockKind] = []
    start = 0
    for kind in t.blocks:
        count = max(0, min(hi, start + kind.count) - max(lo, start))
        if count:
            kinds.append(dataclasses.replace(kind, count=count))
        start += kind.count
    block_params = sum(k.count * k.params for k in kinds)
    return dataclasses.replace(t, blocks=tuple(kinds), params=block_params + (t.outer_params if outer else 0),
                               outer_linears=t.outer_linears if outer else ())


def stage_plans(spec: ModelSizes, s: Settings, stages: int, micro_batches: int,
                gpu_memory_gib: Optional[float] = None) -> List[StagePlan]:
    """Each card's plan for ``stages`` contiguous stages and ``micro_batches`` per optimizer step (1F1B)."""
    plans = []
    for k, (lo, hi) in enumerate(split_blocks(spec.transformer, stages)):
        in_flight = min(micro_batches, stages - k)
        t = stage_transformer(spec.transformer, lo, hi, outer=k in (0, stages - 1))
        settings = dataclasses.replace(
            s, batch=s.batch * in_flight, checkpointed=min(max(s.checkpointed - lo, 0), hi - lo),
            blocks_to_swap=0, num_blocks=hi - lo, validation_pixels=0)
        plans.append(StagePlan(k, (lo, hi), in_flight,
                               build_plan(dataclasses.replace(spec, transformer=t), settings, gpu_memory_gib)))
    return plans


def traffic(spec: ModelSizes, s: Settings, stages: int, micro_batches: int,
            gpu_memory_gib: Optional[float] = None) -> Traffic:
    """What one optimizer step moves per card with a pipeline split, with FSDP over as many cards, and with
    block swap on one card of ``gpu_memory_gib`` (the fewest swapped blocks that fit)."""
    t = spec.transformer
    boundary = s.batch * (s.image_tokens + s.text_tokens) * t.hidden * s.act_bytes  # both streams cross
    outer, blocks = transformer_weight_bytes(t, s)
    weights = outer + sum(blocks)
    swapped = _fewest_swapped(spec, s, gpu_memory_gib) if gpu_memory_gib else None
    return Traffic(pipeline=2.0 * micro_batches * boundary,  # a middle card sends and receives both ways
                   fsdp=2.0 * weights * (stages - 1) / stages,
                   block_swap=None if swapped is None else 2.0 * sum(blocks[len(blocks) - swapped:]),
                   swapped_blocks=swapped, bubble=(stages - 1) / (micro_batches + stages - 1))


def _fewest_swapped(spec: ModelSizes, s: Settings, gpu_memory_gib: float) -> Optional[int]:
    """The fewest blocks one card must swap for its training steps to fit (every block checkpointed), or None
    when none does (the cache pass is the same on one card as on a stage's: block swap does not change it)."""
    checkpointed = dataclasses.replace(s, checkpointed=spec.transformer.num_blocks)
    for swap in range(spec.transformer.num_blocks + 1):
        if build_plan(spec, dataclasses.replace(checkpointed, blocks_to_swap=swap)).training_gib <= gpu_memory_gib:
            return swap
    return None


def format_stages(plans: Sequence[StagePlan], flow: Traffic, micro_batches: int) -> str:
    """The per-card table and the traffic comparison, for ``--plan --pipeline-stages N``."""
    stages = len(plans)
    lines = [f"Pipeline split over {stages} cards (1F1B, {micro_batches} micro-batch{'es' if micro_batches > 1 else ''}"
             " per step: gradient_accumulation_steps), each card's plan:", ""]
    for p in plans:
        verdict = "" if p.plan.fits is None else ("  fits" if p.plan.fits else "  does NOT fit")
        lines.append(f"  card {p.index}: blocks {p.blocks[0]}-{p.blocks[1] - 1}, {p.in_flight} micro-batch"
                     f"{'es' if p.in_flight > 1 else ''} in flight: GPU peak {p.plan.gpu_peak_gib:.2f} GiB "
                     f"(training {p.plan.training_gib:.2f}, cache pass {p.plan.cache_pass_gib:.2f}){verdict}")
    lines += ["", f"Per step and card: pipeline {flow.pipeline / GIB:.3f} GiB; FSDP {flow.fsdp / GIB:.2f} GiB"
              + _swap_text(flow)
              + f"; pipeline bubble {flow.bubble:.0%} of the step"]
    for link, gbps in PCIE_GBPS.items():
        pipe, fsdp, swap = flow.seconds(gbps)
        lines.append(f"  at {link} (~{gbps:.0f} GB/s): pipeline {pipe * 1e3:.1f} ms, FSDP {fsdp:.2f} s"
                     + ("" if not flow.swapped_blocks else f", block swap {swap:.2f} s"))
    return "\n".join(lines) + "\n"


def _swap_text(flow: Traffic) -> str:
    if flow.swapped_blocks is None:
        return "; one card's training does not fit even swapping every block"
    if flow.swapped_blocks == 0:
        return "; one card fits without block swap"
    return f"; block swap on one card {flow.block_swap / GIB:.2f} GiB ({flow.swapped_blocks} blocks)"


def stages_json(plans: Sequence[StagePlan], flow: Traffic) -> dict:
    """The split as one JSON-ready object (``--plan --json --pipeline-stages N``)."""
    return {"fits": all(p.plan.fits is not False for p in plans),
            "stages": [{"card": p.index, "blocks": list(p.blocks), "in_flight": p.in_flight,
                        "gpu_peak_gib": round(p.plan.gpu_peak_gib, 2), "fits": p.plan.fits} for p in plans],
            "traffic_gib": {"pipeline": flow.pipeline / GIB, "fsdp": flow.fsdp / GIB,
                            "block_swap": None if flow.block_swap is None else flow.block_swap / GIB},
            "swapped_blocks_on_one_card": flow.swapped_blocks, "bubble": flow.bubble}
