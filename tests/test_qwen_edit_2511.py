"""Qwen-Image-Edit-2511 trains with the Edit family as it is: its transformer's ``zero_cond_t`` (reference
tokens modulated at timestep 0) happens inside the transformer from the image shapes ``predict`` passes,
so the family's prediction equals Edit-2511's pipeline call (the shared contract checks Edit and 2509)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, List

import torch

from conftest import family_pipeline
from test_family_contract import FAMILY_CASES, family_for, pipeline_run


def test_zero_cond_t_prediction_is_the_pipelines(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    model = tmp_path / "edit-2511"
    shutil.copytree(tiny_model("qwen_image_edit_plus"), model)
    config_file = model / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "zero_cond_t": True}))
    pipe, case = family_pipeline("qwen_image_edit", model), FAMILY_CASES["qwen_image_edit"]
    assert pipe.transformer.zero_cond_t
    calls: List[Any] = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((a, kw, out)),
                                                    with_kwargs=True)
    family = family_for("qwen_image_edit", model)
    try:
        pipeline_run(pipe, family, case, output_type="latent")
    finally:
        handle.remove()
    latents, sigmas, text, refs, expected = case.from_call(calls[1], pipe)
    assert len(refs) == 1
    with torch.no_grad():
        ours = family.predict(pipe.transformer, latents, sigmas, text, refs)
        pipe.transformer.zero_cond_t = False  # the same call without it differs: the flag is exercised
        plain = family.predict(pipe.transformer, latents, sigmas, text, refs)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(plain, expected, atol=1e-4)
