"""Kernels in sandboxes: the provisioner jupyter_client calls, what one start asks for, the sandboxes a kernel
manager runs and the limit on them, the warm pool, the start probe, and a Lab's root shown to kernels."""
