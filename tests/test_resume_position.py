"""Exact resume wherever a checkpoint falls: the loop's position arithmetic (``trainer/run_folder/position.py``) on
accelerate's real loader sharding and gradient accumulation, over a grid of datasets, batch sizes,
accumulation, processes and every checkpoint step (epoch ends, short last windows, a finished run
extended). The end-to-end resumes on the tiny model at the critical points are in
``test_resilience.py``; this file runs no model, so the grid can be exhaustive.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, Dict, Hashable, List, Sequence, Tuple

import pytest
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard, prepare_data_loader
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader

from image_datasets.dataset import SizeGroupedBatchSampler
from trainer.data.data_mix import TrainingData
from trainer.run_folder.position import RunState, micro_batches

Event = Tuple[int, int, int, Tuple[int, ...], bool]  # steps done before it, epoch, micro, batch, sync


@pytest.fixture(scope="module")
def accelerators() -> Any:
    """A real Accelerator per accumulation count (accelerate's state is global: reset around each)."""
    made: Dict[int, Accelerator] = {}

    def get(accumulation: int) -> Accelerator:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        made[accumulation] = Accelerator(gradient_accumulation_steps=accumulation, cpu=True)
        return made[accumulation]

    yield get
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def loader(sampler: SizeGroupedBatchSampler, processes: int, rank: int) -> Any:
    """Rank ``rank``'s loader as ``accelerator.prepare_data_loader`` builds it for ``processes`` processes."""
    plain = DataLoader(list(range(len(sampler.sizes))), batch_sampler=sampler, collate_fn=list)
    return prepare_data_loader(plain, num_processes=processes, process_index=rank, put_on_device=False)


def run(acc: Accelerator, sampler: SizeGroupedBatchSampler, processes: int, rank: int, steps: int,
        state: RunState, acc_step: int = 0) -> Tuple[List[Event], Dict[int, Tuple[Dict[str, Any], int]]]:
    """The engine's loop without a model: what one rank goes through until ``steps`` optimizer steps,
    and at each step what a checkpoint records (the position, and accelerate's accumulation counter,
    which ``save_state`` saves and ``load_state`` restores)."""
    acc.step = acc_step
    events: List[Event] = []
    saved: Dict[int, Tuple[Dict[str, Any], int]] = {}
    for micro, batch in micro_batches(loader(sampler, processes, rank), sampler, state):
        with acc.accumulate():
            events.append((state.step, state.epoch, micro, tuple(batch), acc.sync_gradients))
        if not acc.sync_gradients:
            continue
        state.stepped(micro)
        saved[state.step] = (state.saved(), acc.step)
        if state.step >= steps:
            break
    return events, saved


def samplers() -> List[Tuple[str, Sequence[Hashable], List[int]]]:
    """(name, groups, repeats): one size; two sizes (short batches inside an epoch); two datasets with
    repeats (the multi-dataset data order)."""
    cases = []
    for n in range(1, 8):
        cases.append((f"{n}-one-size", ["a"] * n, [1] * n))
    for n in (3, 5, 6):
        cases.append((f"{n}-two-sizes", ["a" if i % 3 else "b" for i in range(n)], [1] * n))
    cases.append(("two-datasets-repeats", [(0, "a")] * 3 + [(1, "a")] * 2 + [(1, "b")], [3, 3, 3, 1, 1, 1]))
    return cases


@pytest.mark.parametrize("name, groups, repeats", samplers(), ids=[c[0] for c in samplers()])
def test_a_resume_from_every_step_continues_exactly(accelerators: Any, name: str, groups: Sequence[Hashable],
                                                    repeats: List[int]) -> None:
    for batch, accumulation, processes in itertools.product((1, 2, 3), (1, 2, 3, 4), (1, 2, 3)):
        acc = accelerators(accumulation)
        sampler = SizeGroupedBatchSampler(groups, batch, seed=7, repeats=repeats)
        per_rank = len(loader(sampler, processes, 0))
        steps = 2 * -(-per_rank // accumulation) + 1  # two epochs and a step into the third
        case = f"{name} batch {batch} accumulation {accumulation} processes {processes}"
        for rank in range(processes):
            # Two steps past ``steps``: a resume from step ``steps`` extends a finished run.
            reference, saved = run(acc, sampler, processes, rank, steps + 2, RunState())
            assert [e[0] for e in reference if e[4]] == list(range(steps + 2)), case
            for at in range(1, steps + 2):
                position, acc_step = saved[at]
                resumed = RunState()
                resumed.restore(position, accumulation)
                got, _ = run(acc, sampler, processes, rank, steps + 2, resumed, acc_step)
                assert got == [e for e in reference if e[0] >= at], f"{case}, rank {rank}: resumed from step {at}"


def drawn_by_all_ranks(sampler: SizeGroupedBatchSampler, processes: int, micro_batches_each: int,
                       epochs: int) -> List[int]:
    """Samples drawn by every rank's real (sharded) loader: ``epochs`` whole epochs and then
    ``micro_batches_each`` batches per rank."""
    counts: Counter = Counter()
    for epoch in range(epochs + 1):
        sampler.set_epoch(epoch)
        for rank in range(processes):
            shard = list(BatchSamplerShard(sampler, num_processes=processes, process_index=rank))
            counts.update(i for b in (shard[:micro_batches_each] if epoch == epochs else shard) for i in b)
    return [counts[i] for i in range(len(sampler.sizes))]


@pytest.mark.parametrize("name, groups, repeats", samplers(), ids=[c[0] for c in samplers()])
def test_samples_drawn_are_what_the_sharded_loaders_drew(name: str, groups: Sequence[Hashable],
                                                         repeats: List[int]) -> None:
    for batch, processes in itertools.product((1, 2, 3), (1, 2, 3)):
        sampler = SizeGroupedBatchSampler(groups, batch, seed=3, repeats=repeats)
        per_rank = len(BatchSamplerShard(sampler, num_processes=processes, process_index=0))
        for epoch, done in itertools.product(range(3), range(per_rank + 1)):
            assert sampler.drawn(epoch, done, processes) == drawn_by_all_ranks(sampler, processes, done, epoch), \
                f"{name} batch {batch} processes {processes} epoch {epoch} micro-batches {done}"


@pytest.mark.parametrize("count, batch", [(6, 2), (5, 2), (7, 3), (3, 2)])
def test_every_rank_gets_whole_batches_of_one_group_and_the_same_count(count: int, batch: int) -> None:
    """A group's short last batch inside the epoch: accelerate must not drop a round after it nor pad
    with a batch that mixes sizes (ranks would step out of step, or a batch would not stack)."""
    sizes = [(64, 64)] * (count // 2) + [(64, 32)] * (count - count // 2)
    sampler = SizeGroupedBatchSampler(sizes, batch, seed=0)
    for processes in (2, 3):
        shards = [list(BatchSamplerShard(sampler, num_processes=processes, process_index=r))
                  for r in range(processes)]
        assert {len(s) for s in shards} == {len(shards[0])} and len(shards[0]) == -(-len(sampler) // processes)
        assert all(len({sizes[i] for i in b}) == 1 for s in shards for b in s), shards
        assert {i for s in shards for b in s for i in b} == set(range(count)), "every sample is drawn"


class _Entry:
    def __init__(self, name: str):
        self.name = name


def test_samples_seen_stay_what_was_drawn_across_a_dataset_change() -> None:
    """A resume with another dataset list: the checkpoint's counts, plus what the new sampler draws
    from the resume on (not a recount as if the new sampler had run from step 0)."""
    data = TrainingData([_Entry("subject"), _Entry("style")], [None] * 4, [0, 0, 0, 1])  # type: ignore[list-item]
    sampler = SizeGroupedBatchSampler([(0, "a")] * 3 + [(1, "a")], 1, seed=0, repeats=[1, 1, 1, 2])
    state = RunState()
    state.restore({"global_step": 9, "epoch": 1, "micro_batches_done_in_epoch": 2,
                   "samples_seen": {"subject": 7, "style": 3, "gone": 4}}, accumulation=1)
    assert data.samples_seen(sampler, state, 1) == {"subject": 7, "style": 3, "gone": 4}, "nothing drawn yet"
    state.epoch, state.micro_batches_done = 2, 1  # 3 more batches of the rest of epoch 1, 1 of epoch 2
    batches = sampler.batches(1)[2:] + sampler.batches(2)[:1]
    new = Counter("subject" if i < 3 else "style" for b in batches for i in b)
    assert data.samples_seen(sampler, state, 1) == {"subject": 7 + new["subject"], "style": 3 + new["style"],
                                                   "gone": 4}
    assert sum(data.samples_seen(sampler, state, 1).values()) == 14 + len(batches)
