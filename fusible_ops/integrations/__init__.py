"""Integrations with other libraries; each submodule is imported only when asked for."""
