"""The `meclear` command line."""
