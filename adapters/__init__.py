"""Built-in adapters (installed as chatcore.adapters)."""
