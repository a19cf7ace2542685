"""The one exception type users see; the CLI turns it into a single line and exit code 2."""


class SelfSpecError(ValueError):
    """Bad input or an unusable model: reported as one line, never as a traceback."""
