"""User-facing errors: one sentence naming the thing and the fix (CLI exit code 2, HTTP 4xx)."""


class UserError(Exception):
    """A problem with the user's input (a path, a file, an option), not a bug in hybridmoe."""


class ModelFileError(UserError):
    """A model file that is missing, truncated, corrupt or of an unsupported kind."""
