"""blockd: a multi-tenant prefix-cache and KV-block-manager daemon for LLM inference."""

__version__ = "0.1.0"
