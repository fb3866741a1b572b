"""The engine's one exception type: messages name the thing and the reason."""


class EngineError(Exception):
    """A bad config, batch, checkpoint, task or reward, reported in one line."""
