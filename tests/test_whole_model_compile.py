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

from conftest import ONE_SHAPE, read_losses, train_in_process
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
    # (config.patch, not monkeypatch: monkeypatch's undo deletes a dynamo config key)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(inline_single_use_invoke_subgraph=False):
        yield graphs
    torch._dynamo.reset()


def train(model: Path, data: Path, out: Path, *extra: str) -> Any:
    return train_in_process(PROFILE, "qwen_image", f"pretrained_model_name_or_path={model}",
                            f"data_config.img_dir={data}", f"output_dir={out}", "report_to=none", "max_train_steps=3",
                            "checkpointing_steps=100", "learning_rate=1e-2", "gradient_checkpointing=false",
                            ONE_SHAPE, *extra)


def subgraph_calls(gm: torch.fx.GraphModule) -> int:
    """Calls of a nested compile region (``invoke_subgraph``) in one of dynamo's graphs."""
    return sum(1 for node in gm.graph.nodes if node.op == "call_function" and "invoke_subgraph" in str(node.target))


@pytest.mark.e2e
def test_whole_model_compile_trains_as_eager(tiny_qwen_image: Path, one_shape_data: Path, tmp_path: Path,
                                             recorded_graphs: List[torch.fx.GraphModule]) -> None:
    """Three fp32 steps eager and with compile_mode: model: the same losses (relative 1e-5; the graphs may
    reorder a reduction); dynamo traced the transformer once (one batch shape), and each of its 2 blocks is a call
    of the one shared region (compiled once, stamped out)."""
    eager = train(tiny_qwen_image, one_shape_data, tmp_path / "eager", "compile=false")
    assert not eager.compiled and not recorded_graphs
    whole = train(tiny_qwen_image, one_shape_data, tmp_path / "whole", "compile=true", "compile_mode=model")
    assert whole.compiled
    blocks = len(whole.family.blocks(whole.transformer))
    assert blocks == 2 and [subgraph_calls(gm) for gm in recorded_graphs] == [blocks]
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


class _Double(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class _Single(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.a(x))


class _TwoKinds(torch.nn.Module):
    """FLUX's shape: two kinds of blocks, each repeated."""

    def __init__(self) -> None:
        super().__init__()
        self.doubles = torch.nn.ModuleList([_Double() for _ in range(3)])
        self.singles = torch.nn.ModuleList([_Single() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.doubles, *self.singles]:
            x = block(x)
        return x


def test_each_kind_of_block_is_one_region_and_the_output_and_gradients_are_eagers(
        recorded_graphs: List[torch.fx.GraphModule]) -> None:
    """Two block classes make two regions; every block is a region call; forward and gradients equal eager's with
    blocks reusing a region (3 of each kind: the tiny Qwen-Image's 2 blocks never reuse one). A region marked on
    the instances' forward failed this: each reuse ran the first block's weights."""
    from trainer.platform import _region_classes, compile_whole_model

    torch.manual_seed(0)
    model, x = _TwoKinds(), torch.randn(4, 8)
    blocks = [*model.doubles, *model.singles]
    assert set(_region_classes(blocks)) == {_Double, _Single}
    want = model(x)
    want.sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compile_whole_model(model, blocks, None)
    got = model(x)
    got.sum().backward()
    assert torch.allclose(got, want, atol=1e-6)
    assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), want_grads))
    assert len(recorded_graphs) == 1 and subgraph_calls(recorded_graphs[0]) == len(blocks)
    assert [type(b).__name__ for b in blocks] == ["_Double"] * 3 + ["_Single"] * 3
    assert isinstance(blocks[0], _Double) and isinstance(blocks[-1], _Single)
