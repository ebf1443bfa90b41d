import sys

from kvbridge.tools.cli import main

sys.exit(main())
