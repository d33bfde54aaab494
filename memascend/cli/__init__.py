"""The ``memascend`` click CLI. One module per command; commands stay thin (parse, build config, call library)."""
