"""Which reference models take which datasets' samples: one rule table for every entry
point (run settings, cluster scenarios), checked before any process starts."""

from __future__ import annotations

# model -> (the datasets it cannot take, why); lstm is the other way round (below)
_CANNOT_TAKE: dict[str, tuple[frozenset[str], str]] = {
    "lenet5": (
        frozenset({"digits", "heart-disease", "heart-flamby", "shakespeare"}),
        "needs 28x28 or 32x32 images (mnist-5k, fashion-mnist, cifar10)",
    ),
    "cnn": (
        frozenset({"heart-disease", "heart-flamby", "shakespeare"}),
        "needs images (digits, mnist-5k, fashion-mnist, cifar10)",
    ),
}


def model_dataset_problem(model: str, dataset: str) -> str | None:
    """None where `model` can train on `dataset`'s samples, else a sentence saying why not
    and what would do."""
    if (model == "lstm") != (dataset == "shakespeare"):
        return "model lstm and dataset shakespeare go together (character sequences)"
    refused, why = _CANNOT_TAKE.get(model, (frozenset(), ""))
    if dataset in refused:
        return f"model {model} {why}, not {dataset}"
    return None
