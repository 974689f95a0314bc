"""Helpers that start real services and make test data for clotho's tests, benches and soak: a
Prefect server, a moto S3 server, stored groups, perturbed checkpoints, a loaded CPU."""
