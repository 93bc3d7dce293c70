"""The draft's distillation loss: plain cross-entropy at ce_weight 1, zero against itself at
ce_weight 0, and its gradient pulls the student towards the teacher's distribution."""

import pytest

torch = pytest.importorskip("torch", reason="the demo trainer needs PyTorch, which the [test] extra leaves out")

from foretell_demo_train.models import distill_loss, lm_loss  # noqa: E402


def test_ce_weight_one_is_cross_entropy():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    assert torch.allclose(distill_loss(student, teacher, targets, 1.0), lm_loss(student, targets))


def test_pure_kl_is_zero_against_itself_and_positive_otherwise():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 7, generator=g)
    targets = torch.zeros(3, 4, dtype=torch.long)
    assert float(distill_loss(logits, logits, targets, 0.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(distill_loss(logits, torch.randn(3, 4, 7, generator=g), targets, 0.0)) > 0.01


def test_gradient_moves_student_towards_teacher():
    teacher = torch.tensor([[[3.0, 0.0, -1.0]]])
    student = torch.zeros(1, 1, 3, requires_grad=True)
    distill_loss(student, teacher, torch.zeros(1, 1, dtype=torch.long), 0.0).backward()
    # d KL / d logits = q - p: negative where the teacher puts more mass than the student
    assert student.grad[0, 0, 0] < 0 < student.grad[0, 0, 2]
