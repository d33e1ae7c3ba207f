"""Model loading, the backbone adapter (forwards with explicit positions over a KV cache), tokenizers."""
