"""`python -m sdxl_lora.ui [--host H] [--port P] [--auth user:password] [--share] [--datasets D] [--models M] [--runs R]`."""
import sys

from sdxl_lora.ui.app import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
