import sys

from polyserve.cli import main

sys.exit(main())
