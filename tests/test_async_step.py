"""The pieces that keep a training step free of host syncs (``trainer/step/async_step.py``). The loop
that uses them is tested end to end in ``test_train_e2e.py``; the CUDA side in
``test_steps_on_cuda_make_no_synchronizing_call`` there."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from trainer.step.async_step import StepReadout, arm_device_skip, device_skip_supported, step_values, to_device
from trainer.step.optim import FusedBackwardOptimizer, adamw


def _params(seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]


def _with_grads(params: list, value: float = 0.5) -> list:
    for p in params:
        p.grad = torch.full_like(p, value)
    return params


def test_fused_adamw_skips_a_non_finite_step_on_the_device() -> None:
    params = _with_grads(_params())
    opt = adamw(params, lr=0.1, weight_decay=0.01)
    opt.step()  # one real step, so the moments are not zero
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy([opt.state[p] for p in params])
    _with_grads(params, float("nan"))
    arm_device_skip(opt, step_values(torch.tensor(float("nan")), torch.tensor(float("nan"))))
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "a skipped step changed the weights"
    for p, old in zip(params, state):
        assert torch.equal(opt.state[p]["exp_avg"], old["exp_avg"]) and torch.equal(opt.state[p]["step"], old["step"])


def test_an_armed_finite_step_is_the_plain_step() -> None:
    armed, plain = _with_grads(_params()), _with_grads(_params())
    opt_armed, opt_plain = adamw(armed, lr=0.1), adamw(plain, lr=0.1)
    arm_device_skip(opt_armed, step_values(torch.tensor(1.5), torch.tensor(0.3)))
    opt_armed.step()
    opt_plain.step()
    assert all(torch.equal(a, b) for a, b in zip(armed, plain))
    assert not torch.equal(armed[0], _params()[0]), "the step moved the weights"


def test_only_fused_adam_skips_on_the_device() -> None:
    assert device_skip_supported(adamw(_params(), lr=1e-3))
    assert not device_skip_supported(torch.optim.AdamW(_params(), lr=1e-3, foreach=True))
    assert not device_skip_supported(torch.optim.Adafactor(_params(), lr=1e-3))
    assert not device_skip_supported(FusedBackwardOptimizer(_params(), lambda group: adamw(group, lr=1e-3)))
    on_meta = [torch.nn.Parameter(torch.empty(3, device="meta"))]
    assert not device_skip_supported(adamw(on_meta, lr=1e-3)), "no fused kernel on that device: plain AdamW"


@pytest.mark.parametrize("lag", [0, 1])
def test_readout_returns_each_step_once_lag_steps_late(lag: int) -> None:
    readout = StepReadout(torch.device("cpu"), lag=lag)
    returned = []
    for step in (1, 2, 3):
        values = step_values(torch.tensor(float(step)), torch.tensor(step / 10) if step != 2 else None)
        returned.append(readout.push(values, step=step, epoch=0, lr=(1e-4, 2e-4, 3e-4)[step - 1]))
    tail = readout.flush()
    assert [[r.step for r in batch] for batch in returned] == ([[1], [2], [3]] if lag == 0 else [[], [1], [2]])
    assert [r.step for r in tail] == ([] if lag == 0 else [3])
    records = [r for batch in returned for r in batch] + tail
    assert [(r.loss, r.grad_norm, r.lr) for r in records] == [
        (1.0, pytest.approx(0.1), 1e-4), (2.0, None, 2e-4), (3.0, pytest.approx(0.3), 3e-4)]
    assert readout.flush() == []


def test_a_record_with_a_non_finite_number_is_not_finite() -> None:
    readout = StepReadout(torch.device("cpu"), lag=0)
    (nan_loss,) = readout.push(step_values(torch.tensor(float("nan")), None), step=1, epoch=0, lr=0.0)
    (inf_norm,) = readout.push(step_values(torch.tensor(1.0), torch.tensor(math.inf)), step=2, epoch=0, lr=0.0)
    (fine,) = readout.push(step_values(torch.tensor(1.0), torch.tensor(2.0)), step=3, epoch=0, lr=0.0)
    assert (nan_loss.finite, inf_norm.finite, fine.finite) == (False, False, True)


def test_a_pushed_value_is_a_copy() -> None:
    """The engine reuses nothing, but a lagged read must not see later in-place changes."""
    readout = StepReadout(torch.device("cpu"), lag=1)
    values = step_values(torch.tensor(1.0), None)
    readout.push(values, step=1, epoch=0, lr=0.0)
    values.fill_(7.0)
    assert readout.flush()[0].loss == 1.0


def test_to_device_on_the_cpu_casts_like_to() -> None:
    x = torch.randn(2, 3)
    y = to_device(x, torch.device("cpu"), torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x.to(torch.bfloat16))
    assert to_device(x, torch.device("cpu")) is x


def test_the_nan_guard_runs_on_the_device_only_off_the_cpu() -> None:
    """Fused AdamW can skip a step itself; on the CPU the host reads the loss instead (it waits for
    nothing there, and an armed optimizer costs a foreach over its step counters each step)."""
    from trainer.step.async_step import skips_on_device

    fused = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=False)
    assert skips_on_device(fused, torch.device("cuda")) and not skips_on_device(plain, torch.device("cuda"))
    assert not skips_on_device(fused, torch.device("cpu"))


def test_a_lag_free_cpu_readout_reads_at_once() -> None:
    readout = StepReadout(torch.device("cpu"), lag=0)
    values = step_values(torch.tensor(2.0), torch.tensor(0.5))
    (record,) = readout.push(values, step=4, epoch=1, lr=1e-4)
    assert (record.step, record.epoch, record.lr, record.loss, record.grad_norm) == (4, 1, 1e-4, 2.0, 0.5)
    assert readout.flush() == []
