"""The benchmark harness; bench/run.py is its command line."""
