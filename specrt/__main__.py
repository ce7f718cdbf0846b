import sys

from specrt.cli import main

sys.exit(main())
