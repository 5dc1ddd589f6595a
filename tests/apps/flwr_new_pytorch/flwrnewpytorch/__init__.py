# fedlb test fixture: what `flwr new flwrnewpytorch --framework PyTorch --username fedlb`
# writes with flwr 1.24.0, from templates/app/code/__init__.py.tpl
# (Apache-2.0, Flower Labs GmbH). Unchanged except this comment. See tests/apps/README.md.
"""flwrnewpytorch: A Flower / PyTorch app."""
