"""The benches: `python -m bench.NAME` from the repository's root (`make bench` runs them all)."""
