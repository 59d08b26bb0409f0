"""Built-in chatcore plugins: decoders, steerers and commands (installed as chatcore.plugins)."""
