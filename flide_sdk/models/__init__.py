"""Model families. Qwen3.5 (`qwen35`) is the one implemented; `checkpoint` reads its HF-format directories."""
