"""polyserve: an SLO- and power-aware serving control plane for transformer models."""

__version__ = "0.1.0"
