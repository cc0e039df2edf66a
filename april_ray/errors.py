"""The error a bad config or plug-in raises before a job starts: a ValueError whose message begins with the
key it names. Its own module, so the config (which asks the task registry) and the plug-in loader (which the
tasks use) need not import each other."""


class ConfigError(ValueError):
    pass
