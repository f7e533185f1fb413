"""ipw: measure the intelligence efficiency (correct answers per joule) of LLM inference."""

__version__ = "0.1.0"
