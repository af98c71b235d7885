"""Errors the command line prints as one line (no traceback): each names the input and the fix."""


class Eagle3Error(Exception):
    """Base class: the message alone must tell a user what is wrong and how to fix it."""


class ConfigError(Eagle3Error):
    """A pipeline config that does not validate."""


class UnreadableInput(Eagle3Error):
    """A file or directory that is missing, corrupt, or not what it claims to be."""


class ConversionError(Eagle3Error):
    """A checkpoint that cannot be converted without changing what the serving engine computes."""
