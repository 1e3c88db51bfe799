"""The `loraplex` command line: argument parsing (main), the commands, the demo setup."""
