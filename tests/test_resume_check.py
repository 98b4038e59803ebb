"""Resume checks without a training run (the ones with a run, sharing its uninterrupted reference:
``test_resilience.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List

import pytest

from trainer.run_folder import checkpoint as ckpt, resume_check
from utils.errors import UserError


def test_a_checkpoint_that_fails_to_load_names_itself(tmp_path: Path) -> None:
    def load_state(path: str) -> None:
        raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")

    (tmp_path / ckpt.STATE_NAME).write_text(json.dumps({"global_step": 3, "epoch": 0, "batches_done_in_epoch": 3}))

    class Scheduler:
        base_lrs: List[float] = [1e-3]

    with pytest.raises(UserError) as err:
        resume_check.load(tmp_path, load_state, None, [], Scheduler())
    assert str(err.value).startswith(f"cannot resume from {tmp_path}: RuntimeError: PytorchStreamReader failed")
    assert "\n" not in str(err.value) and "weights_only" not in str(err.value)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
