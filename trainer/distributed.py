"""Sharded training: what the engine does differently under FSDP2 and DeepSpeed ZeRO-2/3.

DDP and one process need none of this (each process holds whole tensors). Under FSDP2 the
parameters become DTensor shards in ``prepare()``, under ZeRO-3 they are partitioned, and under
ZeRO-2 they point into one flat buffer; so the engine

* checks the launch really shards as the accelerate config asks (``configure``): accelerate falls
  back to DDP or to one process without a word on a CPU-only machine;
* takes the trained parameters after ``prepare()`` (``trainable_parameters``) and reads the
  gradient norm as a plain tensor (``host_norm``);
* gathers the weights on every process before the main process saves them (``gathered``), as a plain
  module of the model's own class (config.json names ``QwenImageTransformer2DModel``, not
  ``FSDPQwenImageTransformer2DModel``), and lets accelerate restore the sharded model on resume;
* keeps the frozen models (text encoder, VAE, the base pipeline of the export) out of ZeRO-3's
  partitioning (``unpartitioned_loading``): they never go through ``deepspeed.initialize``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object
from loguru import logger

from trainer.families.base import ModelFamily
from trainer.model.adapters import adapter_parameters
from trainer.config import TrainConfig
from trainer.facts.optimizer_choices import OPTIMIZERS
from utils.errors import ConfigError, LaunchError

SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED)
# What accelerate's launcher exports for an FSDP / DeepSpeed config (its multi-process launchers).
REQUESTED_BY_ENV = {"ACCELERATE_USE_FSDP": DistributedType.FSDP, "ACCELERATE_USE_DEEPSPEED": DistributedType.DEEPSPEED}


def sharded(accelerator: Accelerator) -> bool:
    """FSDP or DeepSpeed: accelerate saves and restores the (sharded) model itself."""
    return accelerator.distributed_type in SHARDED


def configure(accelerator: Accelerator, cfg: TrainConfig, family: ModelFamily) -> None:
    """Check the launch, set what DeepSpeed needs from the training config, and hold the other
    processes until the main one has prepared the output folder (it alone creates and removes)."""
    check_launch(accelerator)
    if sharded(accelerator):
        refuse_unsupported(cfg, accelerator.distributed_type)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        # The loader batches through a batch sampler (loader.batch_size is None): say it here.
        if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            ds["train_micro_batch_size_per_gpu"] = cfg.data_config.train_batch_size
        # DeepSpeed clips inside its own step: at the YAML's gradient_clipping, not max_grad_norm.
        if ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = cfg.max_grad_norm
        elif float(ds["gradient_clipping"]) != cfg.max_grad_norm:
            logger.warning(f"DeepSpeed clips gradients at its config's gradient_clipping "
                           f"({ds['gradient_clipping']}), not at max_grad_norm ({cfg.max_grad_norm})")
        for name in ("load_text_encoder", "load_vae"):
            setattr(family, name, _unpartitioned(accelerator, getattr(family, name)))
    accelerator.wait_for_everyone()


def check_launch(accelerator: Accelerator) -> None:
    """Refuse a launch that would not shard as its accelerate config asks, or whose processes do not
    know of each other (each would train alone and race the others on one output folder). Every
    process meets the same refusal: a ``LaunchError``, said once per machine."""
    got, config = accelerator.distributed_type, launcher_config()
    requested = requested_sharding(config)
    if requested is not None and got in (DistributedType.NO, DistributedType.MULTI_CPU):
        raise LaunchError(sharding_needs_gpus(requested[0], got, accelerator.num_processes))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != accelerator.num_processes:
        raise LaunchError(
            f"the launcher started {world} processes but each runs as {accelerator.num_processes} process(es) "
            f"({got.value}): they would train independently on one output folder. On a machine without GPUs "
            "ACCELERATE_USE_CPU=true joins them (DDP over gloo), or --cpu runs one process; on GPUs check the "
            "accelerate config's distributed_type and num_processes")
    if requested is not None and got != requested[1]:
        raise LaunchError(f"{requested[0]} but accelerate set up {got.value}: check the launcher's flags against "
                          "the accelerate config")
    if config is None:
        return
    path, settings = config
    expected = int(settings.get("num_processes", 1) or 1)
    if accelerator.num_processes > expected:
        logger.warning(f"{path}: key 'num_processes' is {expected} but the run has {accelerator.num_processes} "
                       "processes (the launcher's --num_processes wins): each takes a share of every batch")


def requested_sharding(config: Optional[Tuple[Path, Dict[str, Any]]]) -> Optional[Tuple[str, DistributedType]]:
    """Whether the launch asks for FSDP or DeepSpeed, by the launcher's variables or its accelerate
    ``config`` (``launcher_config()``): (where it is asked, which); None when it does not."""
    for variable, wanted in REQUESTED_BY_ENV.items():
        if os.environ.get(variable, "false").lower() == "true":
            return f"{variable}=true (the accelerate config's distributed_type: {wanted.value})", wanted
    name = str(config[1].get("distributed_type", "NO")).upper() if config is not None else "NO"
    if name in ("FSDP", "DEEPSPEED"):
        return f"{config[0]}: key 'distributed_type' is {name}", DistributedType(name)
    return None


def sharding_needs_gpus(asked: str, got: DistributedType, processes: int) -> str:
    """The refusal of FSDP / DeepSpeed on the CPU (``asked``: where it was asked for): accelerate sets up
    one process or DDP there instead. What to do: GPUs; on a machine without them, the unsharded
    launches that run on the CPU (``accelerate launch --cpu`` starts one process whatever
    ``--num_processes`` says; DDP needs ``--multi_gpu`` with ``ACCELERATE_USE_CPU=true``)."""
    head = f"{asked} but accelerate set up {got.value} with {processes} process(es): FSDP and DeepSpeed shard over GPUs"
    if torch.cuda.is_available():
        return f"{head}, and this launch runs on the CPU (--cpu, use_cpu: true or ACCELERATE_USE_CPU=true): drop that"
    script = Path(sys.argv[0]).name if sys.argv[0].endswith(".py") else "SCRIPT"
    return (f"{head}, and this machine has none. To try it on the CPU, train unsharded without --config_file: "
            f"ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 {script} --config ... (DDP), "
            f"or accelerate launch --cpu --num_processes 1 {script} --config ... (one process)")


def launcher_config() -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The accelerate config file named by the ``accelerate launch`` that started this process (its
    parent, or the launcher's torchrun agent in the same process), with its settings; None when the
    process was not started by ``accelerate launch --config_file`` (torchrun, python) or off Linux."""
    import yaml

    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any(a.endswith("accelerate") or "accelerate.commands.launch" in a for a in argv):
        return None
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[1] if re.match(r"--config[_-]file=", arg) else (
            argv[i + 1] if arg in ("--config_file", "--config-file") and i + 1 < len(argv) else None)
        if name:
            path = Path(name) if Path(name).is_absolute() else Path(f"/proc/{os.getppid()}/cwd") / name
            try:
                return Path(name), yaml.safe_load(path.read_text()) or {}
            except (OSError, yaml.YAMLError):
                logger.warning(f"could not read the launcher's config {shlex.quote(name)}")
                return None
    return None


# What a collective (all-reduce, barrier) raises when another process is gone or stalled: gloo's and
# NCCL's transport errors and their timeouts (torch wraps some as DistError, gloo's as RuntimeError).
_COLLECTIVE_FAILURE = re.compile(r"gloo|nccl|connection (reset|closed) by peer|timed out|broken pipe", re.IGNORECASE)
_SETTLE_S = 3.0  # a peer that failed on its own error is still exiting when the transport reports it
_STOPPED_BY = " (SIGSTOP, Ctrl-Z or a debugger)"


def process_ids(accelerator: Accelerator) -> List[Tuple[str, int]]:
    """(host, pid) of every process, by rank (one collective at set-up): whom to name when one is lost."""
    me = (socket.gethostname(), os.getpid())
    return [me] if accelerator.num_processes == 1 else [tuple(p) for p in gather_object([me])]


@dataclasses.dataclass
class LostProcess:
    """Why a collective failed: ``line`` names the rank(s) that died, were stopped or stopped answering."""

    line: str
    ranks: List[int]  # the ranks found dead or stopped (empty when none could be told)

    def message(self, step: int, latest: Optional[Path]) -> str:
        """The one line a survivor ends with: who, at which step, and how to go on."""
        return f"{self.line} at step {step}; " + (
            f"the last checkpoint is {latest}: resume with resume_from_checkpoint=latest" if latest else
            "there is no checkpoint yet: run the same command again") + " once every process can run"

    def records_status(self, rank: int, processes: int) -> bool:
        """Whether ``rank`` writes run_status.json: the first survivor, when the main process is lost."""
        survivors = [r for r in range(processes) if r not in self.ranks]
        return 0 in self.ranks and bool(survivors) and survivors[0] == rank


def collective_failure(exc: BaseException) -> Optional[BaseException]:
    """The failed collective in ``exc`` or the errors it was raised while handling (a launcher's
    SIGTERM arriving as the failure is handled), or None."""
    seen = set()
    error: Optional[BaseException] = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.distributed.DistError) or (
                isinstance(error, RuntimeError) and _COLLECTIVE_FAILURE.search(str(error).split("\n")[0])):
            return error
        error = error.__cause__ or error.__context__
    return None


def lost_process(failure: BaseException, processes: List[Tuple[str, int]], rank: int,
                 timeout_s: int) -> LostProcess:
    """What a surviving process says when a collective failed (``failure``, from ``collective_failure``)
    because another process died, was stopped or stalled past ``timeout_s`` (``processes``:
    ``process_ids``; empty when the failure came before they were known)."""
    others = [(r, host, pid) for r, (host, pid) in enumerate(processes) if r != rank]
    deadline = time.monotonic() + _SETTLE_S
    while True:
        states = [(r, host, pid, _state(host, pid)) for r, host, pid in others]
        lost = [s for s in states if s[3] in ("died", "is stopped")]
        if lost or not others or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if lost:
        what = "; ".join(f"rank {r} (pid {pid}) {state}{_STOPPED_BY if state == 'is stopped' else ''}"
                         for r, _, pid, state in lost)
    else:  # none found here: another machine's, or one that failed on its own error and is still exiting
        who = " and ".join(f"rank {r} on {host}" for r, host, _, state in states if state is None)
        timed_out = re.search("timed out", str(failure), re.IGNORECASE)
        what = f"{who or 'another process'} stopped answering" + (
            f" for {timeout_s} s (ddp_timeout)" if timed_out else " (see its own error)")
    return LostProcess(f"{what}: the run stops here (said by rank {rank})", [r for r, *_ in lost])


def _state(host: str, pid: int) -> Optional[str]:
    """``died``, ``is stopped`` or ``runs`` for a process on this machine; None for another machine's."""
    if host != socket.gethostname():
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "died"
    except OSError:  # no /proc (not Linux): only whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "died"
        except PermissionError:
            pass
        return "runs"
    code = stat.rsplit(")", 1)[1].split()[0]  # after "pid (name)": the state letter
    return "died" if code in ("Z", "X", "x") else "is stopped" if code in ("T", "t") else "runs"


def refuse_unsupported(cfg: TrainConfig, kind: DistributedType) -> None:
    """What the sharded path does not do (each would need whole weights on one process)."""
    unsupported = {"ema_decay": cfg.ema_decay, "blocks_to_swap": cfg.blocks_to_swap, "quantize": cfg.quantize,
                   "fused_backward": cfg.fused_backward, "validation.every_n_steps": cfg.validation.every_n_steps}
    for key, value in unsupported.items():
        if value:
            raise ConfigError(f"key '{key}': value {value} is not supported with {kind.value} (sharded weights); "
                              "unset it, or train with DDP")
    if not OPTIMIZERS[cfg.optimizer].shards:  # each reads whole weights (Muon's matrices, Prodigy's d, z)
        raise ConfigError(f"key 'optimizer': {cfg.optimizer} is not supported with {kind.value} (sharded weights); "
                          "use adamw, adamw8bit or adafactor, or train with DDP")


def prepare_kwargs(accelerator: Accelerator) -> Dict[str, Any]:
    """The transformer is already placed (swapped blocks must stay in host memory); DeepSpeed places
    its own and refuses any ``device_placement``."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return {}
    return {"device_placement": [False, None, None]}


def trainable_parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The trained parameters as the optimizer sees them: FSDP2 replaces them in ``prepare()``."""
    return [p for p in model.parameters() if p.requires_grad]


def host_norm(norm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The gradient norm as a plain tensor (under FSDP2 it is a replicated DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def gathered(accelerator: Accelerator, model: torch.nn.Module, is_main: bool
             ) -> Tuple[Optional[torch.nn.Module], Optional[Dict[str, torch.Tensor]]]:
    """``(module, trained)`` to save on the main process; every process must call this (the shards
    are gathered). Unsharded: the unwrapped module and None. LoRA: the module and its adapter tensors
    by parameter name, gathered. Full fine-tuning: a plain module of the model's class built from
    the gathered state dict (None on the other processes)."""
    plain = accelerator.unwrap_model(model)
    if not sharded(accelerator):
        return plain, None
    if hasattr(plain, "peft_config"):
        return plain, _gathered_adapter(plain, is_main)
    state = accelerator.get_state_dict(model)  # whole on the main process
    if not is_main:
        return None, None
    return _rebuilt(plain, state), None


def _gathered_adapter(model: torch.nn.Module, is_main: bool) -> Dict[str, torch.Tensor]:
    trained = list(adapter_parameters(model).items())
    with _zero3_gathered([p for _, p in trained]):
        # Cloned: ZeRO-2 parameters are views of one flat buffer (safetensors refuses shared storage).
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in trained
                if is_main or hasattr(p, "full_tensor")}


def _zero3_gathered(params: List[torch.nn.Parameter]) -> contextlib.AbstractContextManager:
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def _rebuilt(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module of ``model``'s own class (not accelerate's FSDP subclass) holding ``state``, built
    on the meta device so the host holds the weights once."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        plain = cls.from_config(model.config)
    plain.load_state_dict(state, strict=True, assign=True)
    for name, buffer in model.named_buffers():  # buffers are not sharded, nor in the state when not persistent
        if name not in state:
            owner, _, leaf = name.rpartition(".")
            plain.get_submodule(owner).register_buffer(leaf, buffer.detach().cpu(), persistent=False)
    return plain.eval()


@contextlib.contextmanager
def unpartitioned_loading(accelerator: Accelerator) -> Iterator[None]:
    """Under ZeRO-3 accelerate registers its config with transformers, which then builds every
    ``from_pretrained`` model inside ``deepspeed.zero.Init`` (partitioned and empty): here it does not."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


def _unpartitioned(accelerator: Accelerator, load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with unpartitioned_loading(accelerator):
            return load(*args, **kwargs)
    return wrapper
