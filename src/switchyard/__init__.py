"""Switchyard: an OpenAI-compatible serving gateway for agent workloads."""

__version__ = "0.1.0"
