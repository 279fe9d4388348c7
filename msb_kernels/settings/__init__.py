"""Settings: the one settings class, and the checks of single values it runs."""
