"""User-facing errors: one line, naming the field, printed without a traceback by the CLI."""


class UserError(ValueError):
    """Bad input from the user (config, data, CLI, world size). The CLI prints `error: <msg>`."""


class ConfigError(UserError):
    def __init__(self, field: str, msg: str):
        super().__init__(f"{field}: {msg}")
        self.field = field
