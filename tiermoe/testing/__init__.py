"""Test tooling (random real-shaped checkpoints, FP8 writer, `tiermoe serve` process); core packages never import it."""
