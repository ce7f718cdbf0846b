"""Errors a user can act on. The CLI prints these as one line, without a traceback."""


class SpecrtError(Exception):
    """Base class: a problem with the user's input, files or setup, not a bug in specrt."""


class BundleError(SpecrtError):
    """A bundle directory is missing, incomplete, corrupt or built for something else."""


class UnsupportedModelError(SpecrtError):
    """A checkpoint whose architecture the step-graph exporter does not handle."""


class InvalidRequestError(SpecrtError, ValueError):
    """Bad generation parameters or prompts (e.g. a prompt longer than the context)."""
