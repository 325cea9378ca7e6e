import sys

from tidal.cli import main

sys.exit(main())
