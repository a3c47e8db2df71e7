"""engine_core package."""
