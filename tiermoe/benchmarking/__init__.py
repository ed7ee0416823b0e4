"""The `tiermoe bench ...` commands' engines: measurements and estimates that print tables and plots."""
