"""The error a config.json that Shuttle cannot serve raises (models/config.py, models/families.py)."""


class ConfigError(ValueError):
    """A config.json that Shuttle cannot serve; the message names the file and the field."""
