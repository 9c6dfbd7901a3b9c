"""The one exception type the CLI turns into a one-line message."""


class TurboSpecError(Exception):
    """A user-facing error: bad model files, bad flags, bad input."""
