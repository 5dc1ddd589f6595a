import fedlb.experiments.simulation as _impl

# `flwr run` finds the component by reading this file: it must be `app = module.x`.
app = _impl.client
