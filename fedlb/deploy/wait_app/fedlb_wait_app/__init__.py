"""The Flower app `fedlb server --app` submits first: thin modules pointing at fedlb's."""
