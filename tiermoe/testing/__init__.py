"""Test tooling (random real-shaped checkpoints, FP8 writer, `tiermoe serve` process, would-be host sync counter);
core packages never import it."""
