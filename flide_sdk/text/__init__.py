"""Text to token ids: rendering, the session history and its stable boundaries, the tokenizer fast path."""
