"""A round's plan: the flat token stream and its metadata, and the capacities rounds are padded to."""
