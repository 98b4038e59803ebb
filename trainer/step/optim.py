"""Optimizers and learning-rate schedules.

Each ``optimizer:`` value (their facts: ``trainer/facts/optimizer_choices.py``) is built here from its own
package. Two kinds need more than ``step()``:

- **Schedule-free** optimizers (``adamw_schedulefree``, ``prodigy_schedulefree``) take their steps at
  one point and keep the weights worth evaluating at another (an average). ``evaluation_weights``
  switches the parameters to the latter around validation renders, checkpoint saves and exports, so
  a checkpoint and an exported LoRA hold those weights. A checkpoint saved that way resumes exactly:
  its optimizer state records the evaluation mode, and ``training_weights`` after loading redoes
  the very switch back that the uninterrupted run did after saving.
- **Prodigy** finds its own step size ``d``; ``step_size`` gives ``d x lr``, the learning rate logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, Iterable, Iterator, List, Sequence

import torch
from loguru import logger

from trainer.config import TrainConfig, optimizer_warnings

FUSED_DEVICES = ("cuda", "cpu")  # where torch's fused AdamW has kernels (of the devices we run on)


def build_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter],
                    blocks: Sequence[torch.nn.Module] = ()) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optimizer`` names over ``params``. ``blocks`` are the model's repeated
    blocks: Muon takes the 2-D weights inside them, AdamW the rest.

    Without bitsandbytes the 8-bit request falls back to plain AdamW with one warning.
    """
    params = list(params)
    for warning in optimizer_warnings(cfg):
        logger.warning(warning)
    hidden = _hidden(blocks)
    if cfg.fused_backward:
        single = dataclasses.replace(cfg, fused_backward=False)  # the fields only (not explicit_keys)
        return FusedBackwardOptimizer(params, lambda group: _build(single, group, hidden))
    return _build(cfg, params, hidden)


def _build(cfg: TrainConfig, params: List[torch.nn.Parameter], hidden: set) -> torch.optim.Optimizer:
    adam = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                weight_decay=cfg.adam_weight_decay, eps=cfg.adam_epsilon)
    name = cfg.optimizer
    if name == "muon":
        return _muon(params, hidden, adam)
    if name == "adafactor":
        # Factored second moments: a fraction of AdamW's state, for full fine-tuning on less memory.
        optimizer = torch.optim.Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.adam_weight_decay)
    elif name == "prodigy":
        from prodigyopt import Prodigy

        optimizer = Prodigy(params, **adam, d_coef=cfg.d_coef, safeguard_warmup=cfg.safeguard_warmup,
                            use_bias_correction=cfg.use_bias_correction)
    elif name == "prodigy_schedulefree":
        from prodigyplus import ProdigyPlusScheduleFree

        # One parameter group: split_groups (a step size per group) would only print that it is off.
        optimizer = ProdigyPlusScheduleFree(params, **adam, d_coef=cfg.d_coef, split_groups=False,
                                            use_bias_correction=cfg.use_bias_correction)
    elif name == "adamw_schedulefree":
        from schedulefree import AdamWScheduleFree

        # The schedule is the optimizer's own: its warm-up replaces the scheduler's (held constant).
        optimizer = AdamWScheduleFree(params, **adam, warmup_steps=cfg.lr_warmup_steps)
    elif name == "adamw8bit":
        optimizer = _adamw8bit(params, adam)
    else:
        optimizer = adamw(params, **adam)
    return keep_saved_dtypes(optimizer)


def _adamw8bit(params: List[torch.nn.Parameter], adam: Dict[str, Any]) -> torch.optim.Optimizer:
    try:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **adam)
    except (ImportError, RuntimeError) as exc:
        logger.warning(f"8-bit AdamW unavailable ({exc.__class__.__name__}: {exc}); using torch AdamW")
    return adamw(params, **adam)


def _hidden(blocks: Sequence[torch.nn.Module]) -> set:
    """The ids of the 2-D weights inside the repeated blocks (Muon's share)."""
    return {id(p) for block in blocks for p in block.parameters() if p.ndim == 2}


def _muon(params: List[torch.nn.Parameter], hidden: set, adam: Dict[str, Any]) -> torch.optim.Optimizer:
    """torch's Muon for the 2-D weights inside the blocks, AdamW for the rest (embeddings, the
    output layer, vectors), as Muon's authors train. Its learning rate is scaled to match AdamW's
    update size (``match_rms_adamw``), so one ``learning_rate`` serves both."""
    matrices = [p for p in params if id(p) in hidden]
    rest = [p for p in params if id(p) not in hidden]
    parts: List[torch.optim.Optimizer] = []
    if matrices:
        parts.append(keep_saved_dtypes(torch.optim.Muon(matrices, lr=adam["lr"], weight_decay=adam["weight_decay"],
                                                        adjust_lr_fn="match_rms_adamw")))
    if rest:
        parts.append(keep_saved_dtypes(adamw(rest, **adam)))
    if not parts:
        raise ValueError("no parameters to optimize")
    return parts[0] if len(parts) == 1 else OptimizerGroup(parts)


def adamw(params: List[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """torch's AdamW, fused where its kernel runs: one kernel per step instead of several per tensor
    group, and it can skip a non-finite step on the device (``trainer.step.async_step``)."""
    if all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params):
        return torch.optim.AdamW(params, fused=True, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def keep_saved_dtypes(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``load_state_dict`` restore each state tensor in the dtype it was saved in. torch casts
    every floating state tensor to its parameter's dtype, which changes the arithmetic of state
    kept narrower on purpose (Prodigy + schedule-free's bf16 statistics beside fp32 weights): the
    resumed run would then no longer follow the uninterrupted one."""
    saved: Dict[int, Dict[str, torch.dtype]] = {}

    def remember(opt: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        position = {pid: i for i, pid in enumerate(pid for g in state_dict["param_groups"] for pid in g["params"])}
        saved.clear()
        saved.update({position[pid]: {k: v.dtype for k, v in st.items() if torch.is_tensor(v)}
                      for pid, st in state_dict["state"].items()})

    def restore(opt: torch.optim.Optimizer) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        for index, dtypes in saved.items():
            state = opt.state[params[index]]
            for key, dtype in dtypes.items():
                if torch.is_tensor(state.get(key)) and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)
        saved.clear()

    optimizer.register_load_state_dict_pre_hook(remember)
    optimizer.register_load_state_dict_post_hook(restore)
    return optimizer


def apply_settings(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """Put ``cfg``'s optimizer settings over those a checkpoint's state brought back (a resume with a
    changed ``d_coef``, betas or weight decay applies them, as it says). Only keys a group already
    has are set, and never ``eps`` (Adafactor and Muon keep their own there)."""
    values = {"betas": (cfg.adam_beta1, cfg.adam_beta2), "weight_decay": cfg.adam_weight_decay,
              "d_coef": cfg.d_coef, "safeguard_warmup": cfg.safeguard_warmup,
              "use_bias_correction": cfg.use_bias_correction}
    for group in optimizer.param_groups:
        group.update({key: value for key, value in values.items() if key in group})


# --------------------------------------------------------------------------- schedule-free, step size
@contextlib.contextmanager
def evaluation_weights(optimizer: Any) -> Iterator[None]:
    """Inside: a schedule-free optimizer's parameters hold its evaluation weights (the average it
    keeps); after: its training weights again. Other optimizers: nothing changes. Call it on every
    process alike (each holds its own copy of the weights)."""
    switch = callable(getattr(optimizer, "eval", None)) and callable(getattr(optimizer, "train", None))
    if switch:
        optimizer.eval()
    try:
        yield
    finally:
        if switch:
            optimizer.train()


def training_weights(optimizer: Any) -> None:
    """Put a schedule-free optimizer in training mode before the first step (fresh, or loaded from a
    checkpoint saved with the evaluation weights); other optimizers: nothing."""
    if callable(getattr(optimizer, "train", None)):
        optimizer.train()


def step_size(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate the next step applies, as logged: Prodigy's ``d x lr`` (its adapted step
    size), schedule-free AdamW's own warm-up, otherwise the scheduled ``lr``."""
    group = optimizer.param_groups[0]
    if "d" in group:  # Prodigy, Prodigy + schedule-free
        return float(group["d"] * group["lr"])
    if group.get("warmup_steps"):  # schedule-free AdamW
        return float(group["lr"] * min(1.0, (group["k"] + 1) / group["warmup_steps"]))
    return float(group["lr"])


def build_lr_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, num_processes: int):
    """diffusers' ``get_scheduler``; step counts are scaled because accelerate steps it once per process."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        cfg.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=cfg.lr_warmup_steps * num_processes,
        num_training_steps=cfg.max_train_steps * num_processes,
        num_cycles=cfg.lr_num_cycles,
        power=cfg.lr_power,
    )


# --------------------------------------------------------------------------- several optimizers as one
class OptimizerGroup(torch.optim.Optimizer):
    """Several optimizers stepped, scheduled and saved as one (Muon beside AdamW): ``param_groups``
    is theirs, shared, so a learning-rate schedule reaches every one; ``state_dict`` holds each one's."""

    STATE_KEY = "optimizers"

    def __init__(self, optimizers: List[torch.optim.Optimizer]):
        self.optimizers = optimizers
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        super().__init__(params, {"lr": optimizers[0].defaults["lr"]})
        self.param_groups = [group for opt in optimizers for group in opt.param_groups]

    def step(self, closure: Any = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return {self.STATE_KEY: [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        for opt, state in zip(self.optimizers, state_dict[self.STATE_KEY]):
            opt.load_state_dict(state)
        self.param_groups = [group for opt in self.optimizers for group in opt.param_groups]

    def eval(self) -> None:
        for opt in self.optimizers:
            if callable(getattr(opt, "eval", None)):
                opt.eval()

    def train(self) -> None:
        for opt in self.optimizers:
            training_weights(opt)


def _step_now(opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return hook


class FusedBackwardOptimizer(OptimizerGroup):
    """One small optimizer per parameter, stepped the moment that parameter's gradient is complete
    (a post-accumulate-grad hook) and the gradient freed at once, so a full fine-tune never holds
    every gradient together (4 bytes per parameter saved: 82 GB for Qwen-Image's transformer).

    ``step``/``zero_grad`` are no-ops for the engine; the learning-rate schedule still works through
    ``param_groups``, and ``state_dict`` gathers every per-parameter state for checkpoints. It cannot
    clip by the global norm or accumulate, which the config refuses.
    """

    STATE_KEY = "per_parameter"

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make: Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer]):
        params = list(params)
        super().__init__([make([p]) for p in params])
        for param, opt in zip(params, self.optimizers):
            param.register_post_accumulate_grad_hook(_step_now(opt))

    def step(self, closure: Any = None) -> None:  # the hooks already stepped
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # the hooks already freed the gradients
        return None
