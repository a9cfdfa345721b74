"""Serving: asks queued from any thread, the one round thread that owns the device."""
