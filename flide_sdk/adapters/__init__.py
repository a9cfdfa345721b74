"""Front ends over the engine: the TypeSafe transport, `decide`, `guard` / `route`."""
