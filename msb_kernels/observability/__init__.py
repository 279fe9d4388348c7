"""What the project reports: the audit trail, its metrics, and how a kernel's state is named."""
