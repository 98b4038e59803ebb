"""Per-dataset loss of each optimizer step (``loss/<name>``, ``loss/regularization``), and the weight of
regularisation batches.

A batch belongs to one dataset (``trainer/data/data_mix.py``), so a dataset's loss in a step is the mean
of its micro-batches' losses. The sums stay on the device until the step is logged, and reach the
host through a non-blocking copy, as the step's own loss does (``trainer/step/async_step.py``): no host
sync is added to the step. A one-dataset run needs none of it: its dataset's loss is the step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from trainer.step.async_step import copy_to_host
from trainer.config import REGULARIZATION


@dataclass
class _Pending:
    keys: List[str]  # metric names, in the order of ``host``
    counts: List[int]  # micro-batches summed into each
    host: torch.Tensor
    event: Optional[torch.cuda.Event]


class DatasetLosses:
    """Collects each micro-batch's loss by dataset, and weights the regularisation batches' losses."""

    def __init__(self, names: Sequence[str], roles: Sequence[str], regularization_weight: float,
                 device: torch.device):
        self.names = list(names)
        self.regularization = [role == REGULARIZATION for role in roles]
        self.weight = regularization_weight
        self.cuda = torch.device(device).type == "cuda"
        self.current: List[Tuple[int, torch.Tensor]] = []  # this step's (dataset, unweighted loss)
        self.pending: Dict[int, _Pending] = {}

    def weigh(self, dataset: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss to train on: a regularisation batch's is multiplied by ``regularization_weight``."""
        if len(self.names) > 1:
            self.current.append((dataset, loss.detach()))
        return loss * self.weight if self.regularization[dataset] and self.weight != 1.0 else loss

    def end_step(self, step: int) -> None:
        """Close optimizer step ``step``: its per-dataset sums start their way to the host."""
        if not self.current:
            return
        seen = sorted({d for d, _ in self.current})
        groups = [[loss for d, loss in self.current if d == dataset] for dataset in seen]
        keys = [f"loss/{self.names[d]}" for d in seen]
        regularization = [loss for d, loss in self.current if self.regularization[d]]
        if regularization:
            groups.append(regularization)
            keys.append(f"loss/{REGULARIZATION}")
        sums = torch.stack([torch.stack(group).float().sum() for group in groups])
        host, event = copy_to_host(sums, self.cuda)
        self.pending[step] = _Pending(keys, [len(group) for group in groups], host, event)
        self.current = []

    def fields(self, step: int, loss: float) -> Dict[str, float]:
        """The metrics of step ``step`` (whose overall loss is ``loss``): ``loss/<name>`` for each
        dataset it drew from, and ``loss/regularization`` when it drew regularisation images."""
        if len(self.names) == 1:
            return {f"loss/{self.names[0]}": loss}
        pending = self.pending.pop(step, None)
        if pending is None:
            return {}
        if pending.event is not None:
            pending.event.synchronize()  # the step's own readout has waited for it already
        return {key: value / count for key, value, count in zip(pending.keys, pending.host.tolist(), pending.counts)}
