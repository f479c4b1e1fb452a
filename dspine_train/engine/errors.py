"""Errors the engine raises on bad input, before any generation starts."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A target or draft checkpoint is missing, truncated, corrupted or of an unsupported kind."""


class IncompatibleDraftError(ValueError):
    """The draft was made for another target (width, vocabulary, depth or tokenizer differ)."""


class GenerationInputError(ValueError):
    """A generation request cannot be served (empty prompt, too long for the cache, ...)."""
