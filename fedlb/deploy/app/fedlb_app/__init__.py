"""The Flower app `flwr run` submits: thin modules pointing at fedlb's ServerApp and ClientApp."""
