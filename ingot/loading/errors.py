"""Errors raised while finding and reading model files."""


class CheckpointError(ValueError):
    """A model file or directory is missing, corrupt or unsupported."""
