import sys

from spikeguard.cli import main

sys.exit(main())
