"""Fakes of third-party APIs that cannot be installed here (see each module's docstring)."""
