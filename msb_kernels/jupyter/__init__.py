"""Where msb-kernels meets the Jupyter stack it runs in: the private internals of jupyter_server and jupyter_client
it touches (compat), their log lines it drops, their slow import it defers, and passes over sessions that take
turns with a server's other requests."""
