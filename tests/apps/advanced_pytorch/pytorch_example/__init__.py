# fedlb test fixture: Flower's examples/advanced-pytorch/pytorch_example/__init__.py
# at adap/flower commit fdef7afb1dca3030553be302366cfd285ed6632c (Apache-2.0, Flower Labs GmbH).
# Unchanged except this comment. See tests/apps/README.md.
"""pytorch-example: A Flower / PyTorch app."""
