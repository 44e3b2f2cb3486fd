"""Integrations with other libraries; each submodule is imported only when asked for.

Adapters that run another library's modules on fusible-ops (Hugging Face transformers'
experts, torchtitan's experts). They may import any subpackage below them; nothing in the library imports them.
"""
