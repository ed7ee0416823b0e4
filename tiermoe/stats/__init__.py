"""Expert activation statistics."""
