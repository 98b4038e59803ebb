"""``compile_mode: model``: the whole transformer compiled once with its blocks as one nested compile region
(``trainer/platform.py: compile_whole_model``), the host-work lever of issue 45. On the CPU the graphs run with
the ``aot_eager`` backend (what inductor would get, op by op): a tiny run gives eager's losses, its graph calls
the shared block region once per block, and the config refuses what cannot work with it."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, List

import pytest
import torch

from conftest import read_losses, train_in_process
from trainer.config import load_config
from utils.errors import ConfigError

PROFILE = "train_configs/quickstart_tiny.yaml"
BASE = ["data_config.img_dir=train_configs", "pretrained_model_name_or_path=Qwen/Qwen-Image"]  # only validated


@pytest.fixture
def recorded_graphs(monkeypatch: pytest.MonkeyPatch) -> List[torch.fx.GraphModule]:
    """Every graph dynamo hands to the backend, then run with ``aot_eager`` (seconds on a CPU, not minutes)."""
    graphs: List[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    # Keep a region called once as a region: the tiny model's 2 blocks are each single-use (block 0's input needs
    # no gradient, block 1's does, so they differ), which dynamo would inline; from block 2 on they are reused.
    monkeypatch.setattr(torch._dynamo.config, "inline_single_use_invoke_subgraph", False)
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


def train(model: Path, data: Path, out: Path, *extra: str) -> Any:
    return train_in_process(PROFILE, "qwen_image", f"pretrained_model_name_or_path={model}",
                            f"data_config.img_dir={data}", f"output_dir={out}", "report_to=none", "max_train_steps=3",
                            "checkpointing_steps=100", "learning_rate=1e-2", "gradient_checkpointing=false", *extra)


def subgraph_calls(gm: torch.fx.GraphModule) -> int:
    """Calls of a nested compile region (``invoke_subgraph``) in one of dynamo's graphs."""
    return sum(1 for node in gm.graph.nodes if node.op == "call_function" and "invoke_subgraph" in str(node.target))


@pytest.mark.e2e
def test_whole_model_compile_trains_as_eager(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                             recorded_graphs: List[torch.fx.GraphModule]) -> None:
    """Three fp32 steps eager and with compile_mode: model: the same losses (relative 1e-5; the graphs may
    reorder a reduction); dynamo traced the transformer, and each of its 2 blocks is a call of the one shared
    region (compiled once, stamped out)."""
    eager = train(tiny_qwen_image, sample_data, tmp_path / "eager", "compile=false")
    assert not eager.compiled and not recorded_graphs
    whole = train(tiny_qwen_image, sample_data, tmp_path / "whole", "compile=true", "compile_mode=model")
    assert whole.compiled and recorded_graphs
    blocks = len(whole.family.blocks(whole.transformer))
    # one graph per caption length seen (the batches' shapes differ), each calling the region once per block
    assert blocks == 2 and [subgraph_calls(gm) for gm in recorded_graphs] == [blocks] * len(recorded_graphs)
    got, want = read_losses(tmp_path / "whole"), read_losses(tmp_path / "eager")
    assert len(got) == 3 and all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want)), (got, want)


@pytest.mark.parametrize("keys, named", [
    (["gradient_checkpointing=true"], "gradient_checkpointing: false"),
    (["gradient_checkpointing=3"], "gradient_checkpointing: false"),
    (["gradient_checkpointing=false", "blocks_to_swap=2"], "blocks_to_swap: 0"),
    (["gradient_checkpointing=false", "compile=false"], "compiles nothing"),
    (["gradient_checkpointing=false", "compile_mode=graphs"], "is not one of blocks, model, model_cudagraphs"),
])
def test_the_config_refuses_whole_model_compile_where_it_cannot_work(keys: List[str], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["compile_mode=model", *keys, *BASE], default_family="qwen_image")
    assert "compile_mode" in str(err.value) and named in str(err.value)


def test_the_default_and_a_valid_whole_model_config_load() -> None:
    assert load_config(None, BASE, default_family="qwen_image").compile_mode == "blocks"
    cfg = load_config(None, ["compile_mode=model_cudagraphs", "gradient_checkpointing=false", *BASE],
                      default_family="qwen_image")
    assert cfg.compile_mode == "model_cudagraphs"
