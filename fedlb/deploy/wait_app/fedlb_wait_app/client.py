import fedlb.deploy.waiting as _impl

# `flwr run` finds the component by reading this file: it must be `app = module.app`.
app = _impl.client
