"""The reference models: shapes, parameter counts, one training step."""

from __future__ import annotations

import pytest
import torch

from fedlb.models import MODELS, CharLSTM, LeNet5, SmallCNN, build_model


@pytest.mark.parametrize(
    ("make", "shape", "classes"),
    [
        (LeNet5, (4, 1, 28, 28), 10),
        (lambda: LeNet5(3, image_size=32), (4, 3, 32, 32), 10),
        (SmallCNN, (4, 1, 28, 28), 10),
        (lambda: SmallCNN(3, image_size=32), (4, 3, 32, 32), 10),
        (lambda: CharLSTM(vocab_size=60), None, 60),
    ],
)
def test_models_produce_logits_and_train(make, shape, classes):
    torch.manual_seed(0)  # weights and data fixed: the test must not depend on the draw
    model = make()
    x = torch.randint(0, classes, (4, 20)) if shape is None else torch.rand(shape)
    logits = model(x)
    assert logits.shape == (4, classes)
    y = torch.randint(0, classes, (4,))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.02)
    before = torch.nn.functional.cross_entropy(model(x), y)
    for _ in range(10):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    assert torch.nn.functional.cross_entropy(model(x), y) < before


def test_lenet5_has_the_papers_size():
    assert sum(p.numel() for p in LeNet5().parameters()) == 61_706


def test_build_model_is_seeded_and_names_its_choices():
    a = build_model("cnn", (1, 28, 28), 10, seed=3)
    b = build_model("cnn", (1, 28, 28), 10, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    with pytest.raises(ValueError, match="choose from"):
        build_model("resnet", (1, 28, 28), 10, seed=0)
    assert set(MODELS) == {"mlp", "lenet5", "cnn", "lstm", "logistic"}
    with pytest.raises(ValueError, match="divisible by 4"):
        SmallCNN(image_size=30)


def test_logistic_is_flambys_linear_with_bce_and_threshold():
    """Cross-entropy over (0, z) is BCE of sigmoid(z); argmax is sigmoid(z) > 0.5; the
    weights are drawn as FLamby's nn.Linear(13, 1) after the same seed."""
    import torch
    from torch import nn

    from fedlb.models import build_model

    model = build_model("logistic", (13,), 2, seed=42)
    torch.manual_seed(42)
    theirs = nn.Linear(13, 1)
    assert torch.equal(model.linear.weight, theirs.weight)
    assert torch.equal(model.linear.bias, theirs.bias)
    x = torch.randn(32, 13)
    y = torch.randint(0, 2, (32,))
    ours = nn.functional.cross_entropy(model(x), y)
    z = theirs(x).squeeze(1)
    bce = nn.functional.binary_cross_entropy(torch.sigmoid(z), y.float())
    torch.testing.assert_close(ours, bce)
    ours.backward()
    bce_model = nn.Linear(13, 1)
    bce_model.load_state_dict(theirs.state_dict())
    nn.functional.binary_cross_entropy(torch.sigmoid(bce_model(x).squeeze(1)), y.float()).backward()
    torch.testing.assert_close(model.linear.weight.grad, bce_model.weight.grad)
    assert torch.equal(model(x).argmax(1), (torch.sigmoid(z) > 0.5).long())
    with pytest.raises(ValueError, match="binary"):
        build_model("logistic", (13,), 3, seed=0)
