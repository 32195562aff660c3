"""surge: an LLM inference server. This package holds what every process shares."""

__version__ = "0.1.0"
