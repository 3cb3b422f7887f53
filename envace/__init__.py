"""envace: train and run tool-using LLM agents with world rehearsal (EnvACE)."""

__version__ = "0.1.0"
