"""Errors a user can act on. The CLI prints these as one line, without a traceback."""


class SpecrtError(Exception):
    """Base class: a problem with the user's input, files or setup, not a bug in specrt. `fields`: the inputs it is
    about, by name (a request's "max_new_tokens", a config's field), where it is about some: callers that answer a
    client read them here, not in the message."""

    def __init__(self, *args, fields: tuple[str, ...] = ()):
        super().__init__(*args)
        self.fields = tuple(fields)


class BundleError(SpecrtError):
    """A bundle directory is missing, incomplete, corrupt or built for something else."""


class UnsupportedModelError(SpecrtError):
    """A checkpoint whose architecture the step-graph exporter does not handle."""


class InvalidRequestError(SpecrtError, ValueError):
    """Bad generation parameters or prompts (e.g. a prompt longer than the context)."""
