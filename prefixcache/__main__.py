import sys

from prefixcache.entrypoints.cli import main

sys.exit(main())
