"""Where the training loop stands, and how a resumed run gets back to exactly that point.

The position is ``(epoch, micro-batches this process has trained in that epoch)``. Checkpoints record
it; a resumed run skips exactly those micro-batches of that epoch and goes on.

It is counted in micro-batches, not optimizer steps: an epoch whose micro-batches (per process) are
not a multiple of ``gradient_accumulation_steps`` ends on a short window (accelerate steps at the end
of the loader), and a count in optimizer steps would round that window away: the resumed run would
train the epoch's tail twice and every later batch would shift.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional, Tuple

from accelerate.data_loader import skip_first_batches

POSITION_KEYS = ("global_step", "epoch", "micro_batches_done_in_epoch")
OLD_POSITION_KEY = "batches_done_in_epoch"  # checkpoints written before the count was in micro-batches


@dataclass
class RunState:
    """Where the loop stands; ``saved()`` goes into every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    micro_batches_done: int = 0  # this process's micro-batches of `epoch` already trained
    bad_steps: int = 0  # non-finite steps in a row
    loss_avg: Optional[float] = None  # the smoothed loss of the logs
    last_loss: Optional[float] = None  # the last step's loss (the summary's final loss)
    # What this run's sampler has not drawn itself: samples drawn per dataset name before ``since``
    # (a resumed run: the checkpoint's counts; None for a checkpoint that records none).
    seen_before: Optional[Dict[str, int]] = field(default_factory=dict)
    since: Tuple[int, int] = (0, 0)  # (epoch, micro-batches) where this run's sampler started drawing

    def stepped(self, micro: int) -> None:
        """An optimizer step ended with micro-batch ``micro`` of the epoch."""
        self.step += 1
        self.micro_batches_done = micro + 1

    def saved(self) -> Dict[str, Any]:
        """The position a checkpoint records, and the smoothed loss (so a resumed run's curve goes on)."""
        return {"global_step": self.step, "epoch": self.epoch, "micro_batches_done_in_epoch": self.micro_batches_done,
                **({"loss_smoothed": self.loss_avg} if self.loss_avg is not None else {})}

    def restore(self, saved: Dict[str, Any], accumulation: int) -> None:
        """The position of a checkpoint (``accumulation``: its micro-batches per optimizer step, to
        read a checkpoint that counted optimizer steps), and what it had drawn per dataset."""
        self.restore_position(saved, accumulation)
        self.restore_seen(saved)

    def restore_position(self, saved: Dict[str, Any], accumulation: int) -> None:
        """The loop position and smoothed loss of a checkpoint (see ``restore``)."""
        self.step, self.epoch = saved["global_step"], saved["epoch"]
        self.loss_avg = saved.get("loss_smoothed")
        if "micro_batches_done_in_epoch" in saved:
            self.micro_batches_done = saved["micro_batches_done_in_epoch"]
        else:
            self.micro_batches_done = saved[OLD_POSITION_KEY] * accumulation

    def restore_seen(self, saved: Dict[str, Any]) -> None:
        """What the checkpoint's run had drawn per dataset (``samples_seen``), counted from the restored
        position on (call after ``restore_position``)."""
        seen = saved.get("samples_seen")
        self.seen_before = dict(seen) if isinstance(seen, dict) else None
        self.since = (self.epoch, self.micro_batches_done)


def micro_batches(dataloader: Any, sampler: Any, state: RunState) -> Iterator[Tuple[int, Any]]:
    """This process's micro-batches from ``state``'s position on, epoch after epoch, each with its index
    in the epoch (the step's random seed depends on it). The caller records each optimizer step with
    ``state.stepped``; epochs roll over here. A position at an epoch's very end (a checkpoint on its
    last step) continues with the next epoch."""
    while True:
        done = state.micro_batches_done
        if done < len(dataloader):
            loader = skip_first_batches(dataloader, done) if done else dataloader
            # accelerate's loaders re-set the sampler's epoch from their own iteration count on every
            # pass (a fresh skip-loader counts from 0): give them ours.
            loader.set_epoch(state.epoch)
            sampler.set_epoch(state.epoch)
            yield from enumerate(loader, start=done)
        state.epoch += 1
        state.micro_batches_done = 0
