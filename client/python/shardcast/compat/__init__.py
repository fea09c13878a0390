"""Drop-in replacements for other loaders, served by shardcastd."""
