"""The namespace wing: Linux namespaces sized by cgroups (backend.py), the init run inside
(init_program.py), fork servers, the network helper, scratch disks and host uids.
"""
