"""mkc: compile an LLM decode step into one persistent GPU kernel."""

__version__ = "0.1.0"
