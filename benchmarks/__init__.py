"""Benchmarks and development tools (run from the repository root as `python -m benchmarks.<name>`);
not part of the installed package, and never read by it."""
