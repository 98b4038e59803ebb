"""Test-only launcher shim: run the project's FSDP2 and DeepSpeed paths on CPU processes (gloo).

accelerate 1.15 never selects FSDP or DeepSpeed when its processes run on the CPU: its state turns
only GPU-like types into FSDP (MULTI_CPU stays DDP), and DeepSpeed starts with backend None and
then counts one process per rank. This shim flips the state to FSDP once it is built, hands
DeepSpeed the gloo backend, and runs the entry script given as its first argument:

    ACCELERATE_USE_CPU=true accelerate launch --config_file fsdp.yaml tests/dist_shim.py train.py --config ...
    DS_ACCELERATOR=cpu accelerate launch --config_file zero2.yaml tests/dist_shim.py train.py --config ...

It tests the project's sharded code paths, not accelerate's GPU launcher (NCCL, cuda:N devices).
"""

import os
import runpy
import sys

from accelerate import state as S
from accelerate.utils import DistributedType

_state_init = S.AcceleratorState.__init__
_partial_init = S.PartialState.__init__


def _accelerator_state(self, *args, **kwargs):
    _state_init(self, *args, **kwargs)
    plugin = kwargs.get("fsdp_plugin")
    if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        # Both shared dicts: AcceleratorState() re-syncs from PartialState's on every later call.
        self.distributed_type = S.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = plugin
        if self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        print(f"[dist_shim] rank {self.process_index}: MULTI_CPU -> FSDP (version {plugin.fsdp_version})",
              file=sys.stderr, flush=True)


def _partial_state(self, cpu: bool = False, **kwargs):
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and kwargs.get("backend") is None:
        kwargs["backend"] = "gloo"  # what InitProcessGroupKwargs(backend="gloo") does
    _partial_init(self, cpu, **kwargs)


if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
    import importlib

    # DeepSpeed's shared-memory all-reduce is a CPU speed-up that compiles a C++ extension on first
    # use (a minute); gloo alone gives the same sums.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
S.AcceleratorState.__init__ = _accelerator_state
S.PartialState.__init__ = _partial_state
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
