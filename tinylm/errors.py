"""The error a GGUF file tinylm cannot run raises (its own module, so that the GGUF reader and the
tokenizer, which both raise it, need not import each other)."""


class GGUFError(ValueError):
    """A GGUF file that is missing, unreadable or not a model tinylm can run."""
