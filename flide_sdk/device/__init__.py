"""Device state: the checkpoint pool and the captured CUDA graphs."""
