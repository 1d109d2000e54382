"""Shipped architecture configs (HF config.json files) for `--load-format dummy`."""
