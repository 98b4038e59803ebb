"""Flow-matching maths against closed forms and diffusers' own scheduler."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from trainer.step.flow_matching import (
                                        add_noise,
                                        apply_shift,
                                        flow_matching_loss,
                                        resolution_mu,
                                        sample_sigmas,
                                        shift_sigmas,
                                        time_shift,
                                        velocity_target,
                                        )

QWEN_SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                      max_image_seq_len=8192, time_shift_type="exponential", shift=1.0)


def test_noising_endpoints_and_velocity() -> None:
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    assert torch.equal(add_noise(x0, noise, torch.zeros(2)), x0)
    assert torch.equal(add_noise(x0, noise, torch.ones(2)), noise)
    s = torch.tensor([0.25, 0.75])
    xt = add_noise(x0, noise, s)
    # Moving along the velocity from x_t by sigma lands on the noise (straight path).
    v = velocity_target(x0, noise)
    assert torch.allclose(xt + (1 - s).view(-1, 1, 1, 1) * v, noise, atol=1e-6)
    assert torch.allclose(xt - s.view(-1, 1, 1, 1) * v, x0, atol=1e-6)


def test_uniform_and_logit_normal_moments() -> None:
    g = torch.Generator().manual_seed(0)
    u = sample_sigmas(200_000, "uniform", g)
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    ln = sample_sigmas(200_000, "logit_normal", g, logit_mean=1.0, logit_std=0.5)
    logits = torch.log(ln / (1 - ln))
    assert abs(logits.mean().item() - 1.0) < 0.01 and abs(logits.std().item() - 0.5) < 0.01
    assert 0 < ln.min() and ln.max() < 1


def test_sampling_is_reproducible_from_the_generator() -> None:
    a = sample_sigmas(8, "logit_normal", torch.Generator().manual_seed(3))
    b = sample_sigmas(8, "logit_normal", torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_fixed_shift_matches_closed_form() -> None:
    s = torch.tensor([0.1, 0.5, 0.9])
    assert torch.allclose(shift_sigmas(s, 3.0), 3 * s / (1 + 2 * s))
    assert torch.allclose(shift_sigmas(s, 1.0), s)


def test_resolution_shift_matches_diffusers_scheduler() -> None:
    """Our auto shift equals the sigmas FlowMatchEulerDiscreteScheduler uses at that resolution."""
    sched = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    seq_len = (1024 // 16) ** 2
    mu = resolution_mu(seq_len, sched.config)
    expected_mu = 0.5 + (0.9 - 0.5) * (seq_len - 256) / (8192 - 256)
    assert mu == pytest.approx(expected_mu)
    base = torch.linspace(1.0, 0.05, 10)
    sched.set_timesteps(sigmas=base.numpy().tolist(), mu=mu)
    ours = apply_shift(base, "auto", seq_len, sched.config, fixed_shift=3.0)
    assert torch.allclose(ours, sched.sigmas[:-1].float(), atol=1e-5)
    assert torch.allclose(time_shift(base, mu), ours)


def test_larger_images_shift_towards_noise() -> None:
    s = torch.full((1,), 0.5)
    small = apply_shift(s, "auto", 256, QWEN_SCHEDULER, 3.0)
    large = apply_shift(s, "auto", 4096, QWEN_SCHEDULER, 3.0)
    assert 0.5 < small.item() < large.item() < 1
    assert apply_shift(s, "none", 4096, QWEN_SCHEDULER, 3.0).item() == 0.5


def test_loss_weighting() -> None:
    pred, target = torch.zeros(2, 3), torch.ones(2, 3) * 2
    sig = torch.tensor([0.5, 0.25])
    assert flow_matching_loss(pred, target, sig, "none").item() == pytest.approx(4.0)
    # sigma_sqrt weights each sample by sigma^-2.
    assert flow_matching_loss(pred, target, sig, "sigma_sqrt").item() == pytest.approx((4 * 4 + 16 * 4) / 2)
    cos = flow_matching_loss(pred, target, sig, "cosmap").item()
    w = [2 / (math.pi * (1 - 2 * s + 2 * s * s)) for s in (0.5, 0.25)]
    assert cos == pytest.approx(4 * sum(w) / 2, rel=1e-5)
