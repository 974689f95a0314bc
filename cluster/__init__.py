"""The 4-host test cluster on this machine (cluster.sh) and its Python side (hosts.py)."""
