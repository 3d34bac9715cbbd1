"""User-facing errors: one sentence naming the thing and the fix; the CLI prints it and exits with
code 2. (The server's client errors are server/protocol.py ApiError, a 4xx with OpenAI's body.)"""


class UserError(Exception):
    """A problem with the user's input (a path, a file, an option), not a bug in hybridmoe."""


class ModelFileError(UserError):
    """A model file that is missing, truncated, corrupt or of an unsupported kind."""
