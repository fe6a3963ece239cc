"""stratad: the Strata daemon."""

__version__ = "0.1.0"
