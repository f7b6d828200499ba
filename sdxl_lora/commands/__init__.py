"""The CLI's command groups beside sdxl_lora/cli.py (the entry): the adapter commands, the causal-LM path, and
what the commands share. A front end, like the CLI: the library never imports it."""
