"""Command-line interface: thin wrappers that parse flags and call one library function."""
