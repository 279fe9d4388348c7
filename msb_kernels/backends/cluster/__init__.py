"""Kernels on a cluster's engine: backend.py (engine-neutral), engine.py (what it asks of an engine), swarm.py (Docker
Swarm), and the gateway's door to Docker's API: api_rules.py (what it may ask), socket_proxy.py (the proxy that holds it to that)."""
