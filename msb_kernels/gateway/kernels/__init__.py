"""The kernel service, as jupyter_server's services/kernels: the kernel manager (manager.py) and what it knows of each
kernel (records.py); the REST handlers (handlers.py) and the WebSocket (websocket.py); and the manager's rooms, one per
concept: capacity.py (limits), culling.py, hibernation.py, adoption.py (kernels that outlive the gateway, and the
activity watch), stats.py."""
