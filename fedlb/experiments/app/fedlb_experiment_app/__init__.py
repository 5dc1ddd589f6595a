"""The Flower app `fedlb experiment` submits: thin modules pointing at its simulation."""
