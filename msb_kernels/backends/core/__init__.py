"""The core every backend shares: the contract, sandbox state on disk, host processes, cgroups, ports,
adoption records and the keeper, and the host paths a sandbox shows.
"""
