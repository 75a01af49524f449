"""Typed errors. Every user mistake maps to one of these; the CLI turns them into exit code 2."""


class BmcError(Exception):
    """Base class of all errors bmc raises on purpose."""


class ModelLoadError(BmcError):
    """A model path is missing, unreadable, or its tensors do not match its config."""


class UnsupportedModelError(ModelLoadError):
    """The model_type / GGUF architecture / tensor format is not one bmc implements."""


class InvalidRequestError(BmcError, ValueError):
    """Generation arguments out of range: empty prompt, too long for the context, bad sampling values."""
