"""The version of the metadist distribution."""

__version__ = "0.1.0"
