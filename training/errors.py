"""Exceptions a user can act on. Each message names what is wrong and how to fix it."""


class GradlineError(Exception):
    """Base class: an error whose message is meant for the user, not a traceback."""


class ConfigError(GradlineError):
    """params.yaml or a --set override is invalid."""


class DataError(GradlineError):
    """Input data is missing, malformed or inconsistent with the manifest."""


class ProjectError(GradlineError):
    """The working directory is not a gradline project, or a stage output is missing."""


class TrackingError(GradlineError):
    """The MLflow tracking store or registry cannot do what was asked."""
