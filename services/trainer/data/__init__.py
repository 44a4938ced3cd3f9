"""Dataset formats, tokenisation with chat templates, and packing."""
